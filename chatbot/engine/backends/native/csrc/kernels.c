/* One-token decode of a Llama-family model on the CPU, for chatbot/engine/fast.py.
 *
 * Built at first use with the system C compiler (-O3 -march=native -fopenmp) and loaded
 * through ctypes; every tensor is owned by torch on the Python side and passed as a
 * pointer. One call runs the whole forward pass of one token inside one OpenMP parallel
 * region, so a decode step costs one Python->C transition instead of ~700 torch ops.
 *
 * Weight formats (rows of a [N, K] matrix) are ggml's, as a GGUF file stores them: F32, F16,
 * BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 (blocks of 32) and Q2_K..Q6_K (super-blocks of 256);
 * e.g. Q8_0: fp16 scale d, 32 int8 q, w = d q; Q4_1: fp16 d, fp16 m, 16 bytes, w = d q + m,
 * byte j holding q[j] in its low nibble and q[j + 16] in its high nibble (dequant_block has
 * every layout).
 * Activations (the input vectors of the matrix products) take one of three forms, `act`:
 *   ACT_F32  float32; a block dot product widens the weights to float32 in registers, so a
 *            weight that is exactly representable gives the float32 result (up to order).
 *   ACT_Q8   per block of 32: a float scale and int8 values (ggml's Q8 activations, as
 *            llama.cpp runs Q4_1/Q8_0 files): integer dot products, lossy (~1/254 of the
 *            block's largest value).
 *   ACT_I16  per block of 32: a float scale and int16 values (|x| <= 32767): 16-bit
 *            integer products (madd), an error of at most 1/65534 of the block's largest
 *            value where ACT_Q8 has 1/254: 65534 / 254 = 258x finer. (This is the one place
 *            the figure is derived; the Python side refers here.) The K-quants take the same
 *            int16 per super-block of 256 (prepare_k), so that a super-block's products add
 *            up in int32 before one conversion to float.
 *   With ACT_Q8 the K-quants take int8 per super-block of 256 (ggml's Q8_K, as llama.cpp
 *   runs them): prepare_k's values within +-127, the same integer products, and tile
 *   products that skip the inputs' high byte (one byte product per weight where int16 inputs
 *   take two: --opt fast). Q4_0/Q5_0/Q5_1 take them through their int16 products.
 * Prefill (many inputs at once) has its own batched products: ACT_I16, chatbot_matmul (AVX2
 * and AVX-512: weights unpacked to int16 rows-in-lanes, see there), and ACT_Q8 into matrices in
 * 8-row tiles, chatbot_matmul_x8 (the tiles' bytes as stored; each input's result that of the
 * one-token tile product).
 *
 * Cache: per layer, keys and values as [n_kv_heads, cap, head_dim] float32 (batch 1), the
 * layout of a transformers cache tensor [1, H, S, D] with a preallocated S = cap.
 *
 * The source is one translation unit, built as one file was, so that the compiler sees all of
 * it and inlines across the parts: this file includes them in order, each using what the ones
 * before it define (build.py hashes every file of this folder into the cache key). */

#include "kernels.h"        /* headers, SIMD level, codes, blocks, the structs of kernel_abi.py, helpers */
#include "formats.c"        /* each weight format: its block, dequantized, and its float32 products */
#include "int_products.c"   /* the inputs' int8 / int16 forms (Vec) and the products on them */
#include "tiles.c"          /* Q4_K / Q6_K in 8-row tiles (chatbot_repack) and their products */
#include "pool.c"           /* the team of threads: OpenMP or our own pthreads */
#include "matvec.c"         /* a row's product by format and input form; matrix x vector over a team */
#include "ops.c"            /* RMSNorm, RoPE, soft-capping, attention, SiLU / GELU */
#include "decode.c"         /* one token's forward pass (chatbot_decode) */
#include "decode_batch.c"   /* one token for each of B conversations (chatbot_decode_batch) */
#include "prefill.c"        /* one matrix's product and rows; the batched int16 product (chatbot_matmul) */
#include "prefill_x8.c"     /* the batched int8 product on 8-row tiles (chatbot_matmul_x8) */
#include "experts.c"        /* a mixture's routed experts for a batch of tokens (chatbot_experts) */
#include "quantize.c"       /* float32 packed into Q8_0 / Q4_1 (chatbot_quantize) */
