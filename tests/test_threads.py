"""The thread-count and wait policy for a shared machine (chatbot/engine/backends/native/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import needs_kernels

from chatbot.engine.backends.native import threads


@pytest.mark.parametrize(
    ("cpus", "busy", "most", "expected"),
    [
        (2, 0.0, None, 2),  # quiet: every CPU
        (2, 0.3, None, 2),  # a brief blip does not take a CPU
        (2, 1.0, None, 1),  # one other busy process on two CPUs: one thread
        (2, 6.0, None, 1),  # never fewer than one
        (16, 3.4, None, 13),
        (16, 3.5, None, 12),  # half busy counts as taken
        (16, 0.0, 8, 8),  # capped by `most` (physical cores)
        (4, 0.0, 8, 4),  # and by the CPUs, whatever `most` says
        (1, 0.0, None, 1),
    ],
)
def test_pick_threads(cpus: int, busy: float, most: int | None, expected: int) -> None:
    assert threads.pick_threads(cpus, busy, most) == expected


def test_parse_loadavg() -> None:
    assert threads.parse_loadavg("0.52 0.58 0.59 3/467 12345\n") == (0.52, 3)


def test_busy_cpus_is_the_smaller_of_now_and_the_average(tmp_path: Path) -> None:
    f = tmp_path / "loadavg"
    f.write_text("5.10 4.00 3.00 2/300 99\n")  # heavy average, but only us runnable now
    assert threads.busy_cpus(f) == 1.0
    f.write_text("0.40 1.00 1.00 9/300 99\n")  # a burst that the last minute did not see
    assert threads.busy_cpus(f) == pytest.approx(0.4)
    f.write_text("0.00 0.00 0.00 1/300 99\n")
    assert threads.busy_cpus(f) == 0.0


def test_busy_cpus_without_proc(tmp_path: Path) -> None:
    assert threads.busy_cpus(tmp_path / "missing") >= 0.0


def test_cgroup_cpu_limit(tmp_path: Path) -> None:
    assert threads.cgroup_cpu_limit(tmp_path) is None  # no file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None


def test_available_cpus_follows_the_affinity_mask() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity masks here")
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from chatbot.engine.backends.native.threads import available_cpus; " \
           "print(available_cpus())"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert 1 <= threads.available_cpus() <= (os.cpu_count() or 1)


def test_default_threads_within_bounds() -> None:
    n = threads.default_threads()
    assert 1 <= n <= threads.available_cpus()
    assert threads.default_threads(most=1) == 1


def test_wait_policy_respects_the_users_choice() -> None:
    assert threads.wait_policy_env({}) == {"GOMP_SPINCOUNT": str(threads.SPIN_COUNT)}
    assert threads.wait_policy_env({"OMP_WAIT_POLICY": "active"}) == {}
    assert threads.wait_policy_env({"GOMP_SPINCOUNT": "infinite"}) == {}
    env = {"PATH": "/bin"}
    assert threads.apply_wait_policy(env) == {"GOMP_SPINCOUNT": str(threads.SPIN_COUNT)}
    assert env["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT)
    assert threads.apply_wait_policy(env) == {}  # idempotent


def test_cli_default_threads_follow_the_load(monkeypatch) -> None:
    """Without --threads, the CLI decodes on the CPUs others leave free; --threads wins."""
    import torch

    from chatbot.cli.load import set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "busy_cpus", lambda: 1.0)
        set_threads(None)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "busy_cpus", lambda: 0.0)
        set_threads(None)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(threads, "busy_cpus", lambda: 5.0)
        set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_cli_sets_the_wait_before_torch_loads() -> None:
    """`chatbot` sets GOMP_SPINCOUNT before anything imports torch (libgomp reads it once,
    when loaded), and leaves a user's own OpenMP wait settings alone."""
    code = ("import os, sys; import chatbot.cli.app; "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["False", str(threads.SPIN_COUNT)]
    mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**env, "OMP_WAIT_POLICY": "active"})  # fmt: skip
    assert mine.stdout.split() == ["False", "None"]


@needs_kernels
def test_prefill_product_times_both_thread_counts():
    """The batched integer products (prefill under `--opt auto`: int16 inputs, and int8 ones
    into a matrix in 8-row tiles) each pick 1 or torch's thread count from measured times, as
    the decoder does, and give the same result either way."""
    import numpy as np

    from chatbot.engine.backends.native import kernels, packed
    from devtools.gguf_synthetic import random_blocks

    rows, cols = 64, 512
    raw = random_blocks("Q4_K", rows * cols, np.random.default_rng(0), scale=0.5).reshape(rows, -1)
    p = kernels.from_raw(torch.from_numpy(raw.view(np.uint8)).reshape(rows, -1), kernels.FMT_Q4_K, rows, cols)
    x = torch.randn(12, cols)
    if kernels.matmul_i16(p, x, 1) is None:
        pytest.skip("no batched int16 product on this CPU (AVX2 and up)")
    tiles = kernels.tile_rows(p)
    forms = [(p, kernels.ACT_I16, kernels.matmul_i16, False)]
    if tiles.x8:
        forms.append((tiles, kernels.ACT_Q8, kernels.matmul_x8, True))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for matrix, act, product, int8 in forms:
            packed._tuners.pop((2, int8), None)
            ys = [packed.packed_matmul(matrix, x, act=act) for _ in range(3)]
            assert set(packed._tuners[(2, int8)].seconds) == {1, 2}
            for y in ys:
                assert torch.equal(y, product(matrix, x, 1))
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_few_row_products_time_both_thread_counts_per_matrix_size():
    """A token decoded through transformers' eager forward runs matrix-vector products: they
    take 1 or torch's thread count as measured, for each matrix size apart, and give the same
    result either way; inside a compiled graph (the custom op) they take the compiled step's
    count (`graph_threads`), one by default."""
    import numpy as np

    from chatbot.engine.backends.native import kernels, packed
    from devtools.gguf_synthetic import random_blocks

    rng = np.random.default_rng(0)
    mats = []
    for rows, cols in ((64, 512), (96, 256)):
        raw = random_blocks("Q4_K", rows * cols, rng, scale=0.5).reshape(rows, -1)
        mats.append(
            kernels.from_raw(
                torch.from_numpy(raw.view(np.uint8)).reshape(rows, -1), kernels.FMT_Q4_K, rows, cols
            )
        )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed._matvec_tuners.clear()
        for p in mats:
            x = torch.randn(1, p.cols)
            ys = [packed.packed_matmul(p, x) for _ in range(3)]
            for y in ys:
                assert torch.equal(y, packed.packed_matmul(p, x, threads=1))
        assert set(packed._matvec_tuners) == {(2, 64 * 512), (2, 96 * 256)}
        assert all(set(t.seconds) == {1, 2} for t in packed._matvec_tuners.values())
        packed._matvec_tuners.clear()
        p = mats[0]
        y = torch.ops.chatbot.packed_matmul(torch.ones(1, p.cols), packed._handle(p), kernels.ACT_F32)
        assert torch.equal(y, packed.packed_matmul(p, torch.ones(1, p.cols), threads=1))
        with packed.graph_threads(2):  # the compiled step's own choice, from its step times
            y2 = torch.ops.chatbot.packed_matmul(torch.ones(1, p.cols), packed._handle(p), kernels.ACT_F32)
        assert torch.equal(y2, y) and not packed._matvec_tuners
    finally:
        torch.set_num_threads(before)


def test_capped_threads_holds_in_its_thread_only_and_is_asked_each_time():
    """A server's prefill beside the decode steps: its products take one thread while
    generations decode, asked at each product; other threads and torch's count untouched."""
    import threading

    import torch

    from chatbot.engine.backends.native.threads import cap_threads, capped_threads

    decoding = [True]
    before = torch.get_num_threads()
    seen_elsewhere = []
    with capped_threads(lambda: 1 if decoding[0] else None):
        assert cap_threads(4) == 1
        other = threading.Thread(target=lambda: seen_elsewhere.append(cap_threads(4)))
        other.start()
        other.join()
        decoding[0] = False
        assert cap_threads(4) == 4
        assert torch.get_num_threads() == before
    assert seen_elsewhere == [4]
    assert cap_threads(3) == 3
