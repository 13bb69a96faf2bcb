/* The team of threads a product runs on: OpenMP, or a pool of our own (pthreads).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

/* ---------------------------------------------------------------- threads
 *
 * The parallel code is written against a few calls, so that it builds with OpenMP and
 * without it (clang without libomp, as on macOS), with the same work on the same threads:
 *   team_run(n, fn, arg)  fn(arg) on n threads, the caller one of them; returns when all
 *                         have finished (OpenMP: a parallel region)
 *   team_id(), team_size()  this thread's number in the team, and the team's size
 *   team_share(n)         this thread's iterations of n: OpenMP's schedule(static), the first
 *                         n % size threads taking one more
 *   team_barrier()        no thread goes on before all have come here (an `omp for` ends so)
 *   team_next(&next)      the next iteration of a dynamic schedule (an atomic counter)
 * With OpenMP they are its constructs; without, a pool of our own pthreads (below). Outside
 * team_run the caller is a team of one, as in OpenMP. Which thread computes a row never
 * changes its arithmetic, so the two builds give the same bits. */

typedef struct {
    int lo, hi;
} Span;

static inline int team_id(void);
static inline int team_size(void);

static inline Span team_share(int n) {
    const int size = team_size(), id = team_id(), q = n / size, r = n % size;
    const int lo = q * id + (id < r ? id : r);
    return (Span){lo, lo + q + (id < r)};
}

static inline int team_next(atomic_int *next) {
    return atomic_fetch_add_explicit(next, 1, memory_order_relaxed);
}

/* *to = max(*to, v) for v >= 0 (a reduction): non-negative floats order as their bits do */
static inline void team_max(atomic_uint *to, float v) {
    unsigned bits, old = atomic_load_explicit(to, memory_order_relaxed);
    memcpy(&bits, &v, 4);
    while (bits > old && !atomic_compare_exchange_weak(to, &old, bits)) {
    }
}

static inline float bits_float(unsigned bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef _OPENMP
static inline int team_id(void) { return omp_get_thread_num(); }
static inline int team_size(void) { return omp_get_num_threads(); }
static inline void team_barrier(void) {
#pragma omp barrier
}

static void team_run(int n, void (*fn)(void *), void *arg) {
#pragma omp parallel num_threads(n)
    fn(arg);
}

int chatbot_openmp(void) { return _OPENMP; }
#else
/* The pool: worker i (1..) sleeps on its own word `pool_go[i - 1]` until the caller of a
 * region bumps it; the team then meets at barriers on one word, `pool.phase`, bumped by
 * the last to arrive. A waiting thread spins POOL_SPIN pause-loop iterations, then sleeps on
 * a condition variable: libgomp's wait as engine/threads.py sets it (GOMP_SPINCOUNT), cheap
 * when partners arrive together, and giving the CPU away when one of them is parked. With
 * more threads than CPUs a partner is likely parked: a short spin. Workers stay for the
 * next region; a team larger than any before starts the threads it lacks. */
#define POOL_MAX 256         /* threads in a team at most (more asked for: this many) */
#define POOL_SPIN 10000      /* = engine/threads.py SPIN_COUNT */
#define POOL_SPIN_CROWDED 100
#define POOL_STACK (8 << 20) /* bytes of stack per worker (macOS gives threads 512 KB) */

typedef struct {
    _Alignas(64) atomic_uint word; /* waiters wait for it to change; a cache line each */
    atomic_int sleepers;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} Signal;

static struct {
    pthread_mutex_t run; /* one region at a time: two Python threads may call in at once */
    int started;         /* workers running */
    int size;            /* this region's team */
    void (*fn)(void *);
    void *arg;
    atomic_int spin;
    atomic_int arrived; /* at the current barrier */
    int cpus;
    Signal phase;
} pool = {.run = PTHREAD_MUTEX_INITIALIZER};
static Signal pool_go[POOL_MAX];
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static _Thread_local int pool_id = 0, pool_size = 1;

static inline int team_id(void) { return pool_id; }
static inline int team_size(void) { return pool_size; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void signal_init(Signal *s) {
    atomic_init(&s->word, 0);
    atomic_init(&s->sleepers, 0);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
}

/* Wait for s->word to differ from `seen`. A sleeper counts itself (seq_cst) before it looks
 * at the word again; signal_bump changes the word (seq_cst) before it looks at the count:
 * one of the two sees the other, so no sleeper misses its wake-up. */
static void signal_wait(Signal *s, unsigned seen) {
    const int spin = atomic_load_explicit(&pool.spin, memory_order_relaxed);
    for (int i = 0; i < spin; i++) {
        if (atomic_load_explicit(&s->word, memory_order_acquire) != seen) return;
        cpu_relax();
    }
    pthread_mutex_lock(&s->lock);
    atomic_fetch_add(&s->sleepers, 1);
    while (atomic_load(&s->word) == seen) pthread_cond_wait(&s->cond, &s->lock);
    atomic_fetch_sub(&s->sleepers, 1);
    pthread_mutex_unlock(&s->lock);
}

static void signal_bump(Signal *s) {
    atomic_fetch_add(&s->word, 1);
    if (atomic_load(&s->sleepers)) {
        pthread_mutex_lock(&s->lock);
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->lock);
    }
}

static void team_barrier(void) {
    if (pool_size < 2) return;
    /* the phase cannot move on before this thread arrives */
    const unsigned seen = atomic_load_explicit(&pool.phase.word, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == pool_size - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        signal_bump(&pool.phase); /* releases what every thread wrote before it arrived */
    } else {
        signal_wait(&pool.phase, seen);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    Signal *go = &pool_go[id - 1];
    /* one bump per region, and the next one comes after this thread ends the region */
    for (unsigned seen = 0;; seen++) {
        signal_wait(go, seen);
        pool_id = id;
        pool_size = pool.size;
        pool.fn(pool.arg);
        team_barrier();
    }
    return NULL;
}

/* A fork copies only the thread that forks: the child starts its own workers. */
static void pool_fork_prepare(void) { pthread_mutex_lock(&pool.run); }
static void pool_fork_parent(void) { pthread_mutex_unlock(&pool.run); }
static void pool_fork_child(void) {
    pool.started = 0;
    atomic_store(&pool.arrived, 0);
    signal_init(&pool.phase); /* a worker may have held its lock */
    pthread_mutex_unlock(&pool.run);
}

static void pool_setup(void) {
    signal_init(&pool.phase);
    atomic_init(&pool.spin, POOL_SPIN);
    long cpus = 0;
#ifdef _SC_NPROCESSORS_ONLN
    cpus = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    pool.cpus = cpus > 0 ? (int)cpus : POOL_MAX;
    pthread_atfork(pool_fork_prepare, pool_fork_parent, pool_fork_child);
}

/* Start worker `id`; 0 on success. */
static int pool_start(int id) {
    signal_init(&pool_go[id - 1]);
    pthread_attr_t attr;
    if (pthread_attr_init(&attr)) return -1;
    size_t stack = 0;
    pthread_attr_getstacksize(&attr, &stack);
    if (stack < POOL_STACK) pthread_attr_setstacksize(&attr, POOL_STACK);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread;
    const int failed = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)id);
    pthread_attr_destroy(&attr);
    return failed;
}

static void team_run(int n, void (*fn)(void *), void *arg) {
    if (n > 1) {
        pthread_once(&pool_once, pool_setup);
        pthread_mutex_lock(&pool.run);
        n = n < POOL_MAX ? n : POOL_MAX;
        while (pool.started < n - 1 && pool_start(pool.started + 1) == 0) pool.started++;
        n = n < pool.started + 1 ? n : pool.started + 1; /* fewer where threads cannot start */
        if (n > 1) {
            pool.size = n;
            pool.fn = fn;
            pool.arg = arg;
            atomic_store_explicit(&pool.spin, n > pool.cpus ? POOL_SPIN_CROWDED : POOL_SPIN, memory_order_relaxed);
            for (int i = 0; i < n - 1; i++) signal_bump(&pool_go[i]);
            pool_id = 0;
            pool_size = n;
            fn(arg);
            team_barrier(); /* the region's end: everyone is done with `arg` */
            pool_size = 1;
            pthread_mutex_unlock(&pool.run);
            return;
        }
        pthread_mutex_unlock(&pool.run);
    }
    fn(arg); /* a team of one */
}

int chatbot_openmp(void) { return 0; }
#endif

