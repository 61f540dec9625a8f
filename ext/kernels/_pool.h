/* moed's compute thread pool: one parallel loop at a time over numbered items.

   moed_pool_run(n_threads, n_items, fn, ctx) calls fn(ctx, i, tid) once for every item
   i < n_items and returns when all calls have returned. tid < n_threads names the
   thread running the call (0 is the caller), for per-thread scratch. Which thread runs
   which item is decided at run time, so an item must compute whole outputs, with the
   same code whoever runs it: then results do not depend on the thread count.

   Why not OpenMP: a static split (`schedule(static)`) hands each thread its share up
   front, so the caller waits for a worker that has not woken yet (a futex wake with
   OMP_WAIT_POLICY=PASSIVE, ~60 us) or that lost its core to another process (spinning
   workers then made 2 threads decode at 0.14x one thread). Here:
   - items are claimed in chunks (about MOED_POOL_CHUNKS_PER_THREAD per thread) from one
     atomic counter, by the caller too; the caller then waits only for chunks a worker
     has claimed and not finished, so a worker that never woke or lost its core costs
     nothing but the chunk it holds;
   - a worker that finishes looks for the next job for spin_ns (MOED_POOL_SPIN_NS, 50 us;
     `pause` for the first 5 us, then sched_yield() between looks so that another
     thread that wants the core gets it), then sleeps on a futex (a condition variable
     off Linux); the caller makes the wake-up system call only when a worker sleeps.
     Decode issues a kernel call every few microseconds, so while a model decodes the
     workers rarely sleep, and once it stops they leave the CPU after spin_ns;
   - a caller that waited long for a worker that lost its core mid-chunk runs the next
     jobs alone, for longer the more often it happens (MOED_POOL_STALL_NS);
   - one job at a time: a caller that finds the pool busy (another Python thread's
     kernel call) runs its items alone.
   The pool starts lazily with max(n_threads) - 1 workers (grown on demand), forgets its
   workers in a forked child (pthread_atfork: the child has none of them and starts its
   own on first use), and stops and joins them at exit.

   With MOED_POOL_SERIAL defined (or no C11 atomics) every call runs its items in order
   on the caller.

   Measured on a shared 2-core AMD EPYC (Zen 4) VM, bench/decode_overhead.py --rounds 5
   --tokens 48, 2T/1T per round, interleaved with the OpenMP build (OMP_WAIT_POLICY=
   PASSIVE): a 4-layer qwen3_moe (hidden 1024, 32 experts, top-4) in bf16 1.43-1.51
   (OpenMP 1.15), its int4 repack 1.47 (1.16), when nothing else ran; with one spinning
   process in the same session 1.11 (OpenMP ACTIVE 0.28). No thread count gets more
   than its session's share of the CPU: with a process of another session busy on the
   other core, 2 threads decode at about 1.0x one thread (worker runs ~2 % of chunks). */
#ifndef MOED_POOL_H
#define MOED_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef void (*moed_pool_fn)(void *ctx, Py_ssize_t item, int tid);

#ifndef MOED_POOL_SPIN_NS
#define MOED_POOL_SPIN_NS 50000      /* a worker's spin after a job before it sleeps */
#endif

#if defined(MOED_POOL_SERIAL) || defined(__STDC_NO_ATOMICS__) || defined(_WIN32)

static int moed_pool_threaded(void) { return 0; }
static void moed_pool_set_spin_ns(long ns) { (void)ns; }
static long moed_pool_spin_ns(void) { return 0; }
static int moed_pool_workers(void) { return 0; }
static void moed_pool_stats(uint64_t *out) { out[0] = out[1] = out[2] = out[3] = out[4] = out[5] = 0; }
static void moed_pool_run(int n_threads, Py_ssize_t n_items, moed_pool_fn fn, void *ctx)
{
    (void)n_threads;
    for (Py_ssize_t i = 0; i < n_items; i++)
        fn(ctx, i, 0);
}

#else

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOED_POOL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MOED_POOL_PAUSE() __asm__ __volatile__("yield")
#else
#define MOED_POOL_PAUSE() ((void)0)
#endif

#define MOED_POOL_MAX_WORKERS 255
#define MOED_POOL_YIELD_NS 20000
/* A stall: the caller, done with its own chunks, waited more than MOED_POOL_STALL_NS
   and longer than it took to run them, for a chunk a worker holds (a worker that lost
   its core to another process mid-chunk; the wait is up to the kernel's time slice).
   After a stall the pool runs the next `backoff` jobs on the caller alone (backoff
   doubles with each stall from MOED_POOL_BACKOFF_MIN up to MOED_POOL_BACKOFF_MAX jobs,
   and shrinks by one with each job that does not stall), so a loaded machine costs about what
   one thread costs. */
/* A waiting worker spins with `pause` for this long, then calls sched_yield() between
   looks: on an idle core that returns at once (the worker still sees a job within a
   microsecond or so), and when another thread wants the core it gets it. */
#ifndef MOED_POOL_SPIN_YIELD_NS
#define MOED_POOL_SPIN_YIELD_NS 5000
#endif
#ifndef MOED_POOL_STALL_NS
#define MOED_POOL_STALL_NS 50000
#endif
#define MOED_POOL_BACKOFF_MIN 16
#define MOED_POOL_BACKOFF_MAX 4096

/* Chunks per thread: enough that a late or descheduled thread's share is taken by the
   others, few enough that claiming (one compare-and-swap each) stays out of sight. */
#define MOED_POOL_CHUNKS_PER_THREAD 8

/* The job word packs the job's sequence number (high 32 bits) and the next chunk to
   claim (low 32 bits): a claim is a compare-and-swap of the whole word, so a worker
   still holding a finished job's number can never claim a chunk of a later job. */
#define MOED_POOL_SEQ(w) ((uint32_t)((w) >> 32))
#define MOED_POOL_IDX(w) ((uint32_t)(w))

typedef struct {
    /* Written when a job is published, read by spinning workers. */
    _Alignas(64) _Atomic uint32_t seq;     /* futex word: the latest job's seq */
    _Atomic int stop;
    _Atomic(moed_pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic Py_ssize_t n_items;
    _Atomic Py_ssize_t grain;              /* items per chunk */
    _Atomic int n_helpers;                 /* workers with index < this join the job */
    /* Claims (caller and workers). */
    _Alignas(64) _Atomic uint64_t word;    /* seq << 32 | next chunk */
    /* Written by workers. */
    _Alignas(64) _Atomic uint32_t done;    /* chunks of the job finished by workers */
    _Atomic int sleepers;
    _Atomic uint64_t stat_worker_chunks, stat_sleeps;
    /* The caller's (the owner of `busy`). */
    _Alignas(64) _Atomic int busy;
    int solo_left, backoff;                /* see MOED_POOL_STALL_NS */
    _Atomic uint64_t stat_jobs, stat_chunks, stat_stalls, stat_wait_ns;
    _Atomic long spin_ns;
    int n_workers;
    pid_t pid;
    pthread_t threads[MOED_POOL_MAX_WORKERS];
#ifndef __linux__
    pthread_mutex_t lock;
    pthread_cond_t cond;
#endif
} moed_pool_t;

static moed_pool_t moed_pool_state = {.spin_ns = MOED_POOL_SPIN_NS};
static pthread_mutex_t moed_pool_grow_lock = PTHREAD_MUTEX_INITIALIZER;
static int moed_pool_hooks_done = 0;
static int moed_pool_index[MOED_POOL_MAX_WORKERS];

static int moed_pool_threaded(void) { return 1; }
static void moed_pool_set_spin_ns(long ns) { atomic_store(&moed_pool_state.spin_ns, ns); }
static long moed_pool_spin_ns(void) { return atomic_load(&moed_pool_state.spin_ns); }
static int moed_pool_workers(void) { return moed_pool_state.n_workers; }
/* Since start: [0] jobs run on more than one thread, [1] their chunks, [2] chunks
   workers ran, [3] times a worker went to sleep, [4] stalls (see moed_pool_run), [5] ns
   callers waited for workers' chunks. */
static void moed_pool_stats(uint64_t *out)
{
    out[4] = atomic_load(&moed_pool_state.stat_stalls);
    out[5] = atomic_load(&moed_pool_state.stat_wait_ns);
    out[0] = atomic_load(&moed_pool_state.stat_jobs);
    out[1] = atomic_load(&moed_pool_state.stat_chunks);
    out[2] = atomic_load(&moed_pool_state.stat_worker_chunks);
    out[3] = atomic_load(&moed_pool_state.stat_sleeps);
}

static inline int64_t moed_pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void moed_pool_sleep(moed_pool_t *p, uint32_t seen)
{
#ifdef __linux__
    syscall(SYS_futex, &p->seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->lock);
    while (atomic_load(&p->seq) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->cond, &p->lock);
    pthread_mutex_unlock(&p->lock);
#endif
}

static void moed_pool_wake_all(moed_pool_t *p)
{
#ifdef __linux__
    syscall(SYS_futex, &p->seq, FUTEX_WAKE_PRIVATE, MOED_POOL_MAX_WORKERS, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->cond);
    pthread_mutex_unlock(&p->lock);
#endif
}

/* Claim chunks of job `seq` (chunk c: items [c * grain, (c + 1) * grain) of n_items)
   and run their items until none is left; returns how many chunks ran. */
static uint32_t moed_pool_drain(moed_pool_t *p, uint32_t seq, moed_pool_fn fn, void *ctx,
                                Py_ssize_t n_items, Py_ssize_t grain, int tid)
{
    uint32_t ran = 0, n = (uint32_t)((n_items + grain - 1) / grain);
    uint64_t w = atomic_load_explicit(&p->word, memory_order_acquire);
    for (;;) {
        if (MOED_POOL_SEQ(w) != seq || MOED_POOL_IDX(w) >= n)
            return ran;
        if (!atomic_compare_exchange_weak_explicit(&p->word, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        Py_ssize_t i = (Py_ssize_t)MOED_POOL_IDX(w) * grain;
        Py_ssize_t end = i + grain < n_items ? i + grain : n_items;
        for (; i < end; i++)
            fn(ctx, i, tid);
        ran++;
        w = atomic_load_explicit(&p->word, memory_order_acquire);
    }
}

static void *moed_pool_worker(void *arg)
{
    moed_pool_t *p = &moed_pool_state;
    int index = *(int *)arg;
    uint32_t seen = atomic_load(&p->seq);
    for (;;) {
        /* Wait for a new job: spin for spin_ns, then sleep until woken. */
        uint32_t seq = atomic_load_explicit(&p->seq, memory_order_acquire);
        if (seq == seen && !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
            int64_t start = moed_pool_now_ns(), now = start;
            int64_t until = start + atomic_load_explicit(&p->spin_ns, memory_order_relaxed);
            for (;;) {
                if (now - start < MOED_POOL_SPIN_YIELD_NS) {
                    for (int i = 0; i < 16; i++)
                        MOED_POOL_PAUSE();
                } else {
                    sched_yield();
                }
                seq = atomic_load_explicit(&p->seq, memory_order_acquire);
                if (seq != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
                    break;
                now = moed_pool_now_ns();
                if (now > until) {
                    /* seq_cst: pairs with the caller's store of seq, then load of sleepers */
                    atomic_fetch_add(&p->sleepers, 1);
                    atomic_fetch_add_explicit(&p->stat_sleeps, 1, memory_order_relaxed);
                    if (atomic_load(&p->seq) == seen && !atomic_load(&p->stop))
                        moed_pool_sleep(p, seen);
                    atomic_fetch_sub(&p->sleepers, 1);
                    start = now = moed_pool_now_ns();
                    until = start + atomic_load_explicit(&p->spin_ns, memory_order_relaxed);
                }
            }
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = seq;
        if (index >= atomic_load_explicit(&p->n_helpers, memory_order_relaxed))
            continue;
        /* These may already describe a later job if this worker is late; then the job
           word's seq differs from `seq` and drain claims nothing. */
        moed_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
        Py_ssize_t n = atomic_load_explicit(&p->n_items, memory_order_relaxed);
        Py_ssize_t grain = atomic_load_explicit(&p->grain, memory_order_relaxed);
        uint32_t ran = moed_pool_drain(p, seq, fn, ctx, n, grain, index + 1);
        if (ran) {
            atomic_fetch_add_explicit(&p->stat_worker_chunks, ran, memory_order_relaxed);
            atomic_fetch_add_explicit(&p->done, ran, memory_order_release);
        }
    }
}

static void moed_pool_stop(void)
{
    moed_pool_t *p = &moed_pool_state;
    if (p->n_workers == 0 || p->pid != getpid())
        return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->seq, 1);
    moed_pool_wake_all(p);
    for (int i = 0; i < p->n_workers; i++)
        pthread_join(p->threads[i], NULL);
    p->n_workers = 0;
    atomic_store(&p->stop, 0);
}

static void moed_pool_after_fork_child(void)
{
    /* The child has only the forking thread: forget the parent's workers (their
       stacks stay allocated; the child starts its own on first use). */
    moed_pool_t *p = &moed_pool_state;
    p->n_workers = 0;
    p->pid = getpid();
    atomic_store(&p->busy, 0);
    atomic_store(&p->sleepers, 0);
    atomic_store(&p->stop, 0);
    p->solo_left = p->backoff = 0;
#ifndef __linux__
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->cond, NULL);
#endif
    pthread_mutex_init(&moed_pool_grow_lock, NULL);
}

/* Start workers until the pool has `want` (at most MOED_POOL_MAX_WORKERS); returns how
   many it has (fewer if pthread_create fails). */
static int moed_pool_grow(int want)
{
    moed_pool_t *p = &moed_pool_state;
    if (want > MOED_POOL_MAX_WORKERS)
        want = MOED_POOL_MAX_WORKERS;
    pthread_mutex_lock(&moed_pool_grow_lock);
    if (!moed_pool_hooks_done) {
        moed_pool_hooks_done = 1;
#ifndef __linux__
        pthread_mutex_init(&p->lock, NULL);
        pthread_cond_init(&p->cond, NULL);
#endif
        p->pid = getpid();
        pthread_atfork(NULL, NULL, moed_pool_after_fork_child);
        atexit(moed_pool_stop);
    }
    while (p->n_workers < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        moed_pool_index[p->n_workers] = p->n_workers;
        int rc = pthread_create(&p->threads[p->n_workers], &attr, moed_pool_worker,
                                &moed_pool_index[p->n_workers]);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        p->n_workers++;
    }
    int have = p->n_workers;
    pthread_mutex_unlock(&moed_pool_grow_lock);
    return have;
}

static void moed_pool_run(int n_threads, Py_ssize_t n_items, moed_pool_fn fn, void *ctx)
{
    moed_pool_t *p = &moed_pool_state;
    if (n_threads > n_items)
        n_threads = (int)n_items;
    int expected = 0;
    if (n_threads <= 1 || !atomic_compare_exchange_strong(&p->busy, &expected, 1)) {
        for (Py_ssize_t i = 0; i < n_items; i++)
            fn(ctx, i, 0);
        return;
    }
    if (p->solo_left > 0) {
        p->solo_left--;
        atomic_store_explicit(&p->busy, 0, memory_order_release);
        for (Py_ssize_t i = 0; i < n_items; i++)
            fn(ctx, i, 0);
        return;
    }
    int helpers = n_threads - 1;
    if (p->n_workers < helpers) {
        int have = moed_pool_grow(helpers);
        helpers = have < helpers ? have : helpers;
    }
    Py_ssize_t grain = n_items / ((Py_ssize_t)(helpers + 1) * MOED_POOL_CHUNKS_PER_THREAD);
    if (grain < 1)
        grain = 1;
    while ((n_items + grain - 1) / grain > (Py_ssize_t)UINT32_MAX - 1)
        grain *= 2;
    uint32_t n = (uint32_t)((n_items + grain - 1) / grain);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n_items, n_items, memory_order_relaxed);
    atomic_store_explicit(&p->grain, grain, memory_order_relaxed);
    atomic_store_explicit(&p->n_helpers, helpers, memory_order_relaxed);
    uint32_t seq = atomic_load(&p->seq) + 1;
    atomic_store(&p->word, (uint64_t)seq << 32);
    atomic_store(&p->seq, seq);
    if (atomic_load(&p->sleepers) > 0)
        moed_pool_wake_all(p);   /* a futex cannot pick which sleepers wake */
    int64_t t0 = moed_pool_now_ns();
    uint32_t mine = moed_pool_drain(p, seq, fn, ctx, n_items, grain, 0);
    int64_t t1 = moed_pool_now_ns();
    /* Every chunk is claimed; wait for those a worker is still running. Past
       MOED_POOL_YIELD_NS, yield between looks: the worker may be waiting for this core. */
    uint32_t spins = 0;
    int64_t yield_at = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) + mine < n) {
        MOED_POOL_PAUSE();
        if (++spins % 256 == 0) {
            int64_t now = moed_pool_now_ns();
            if (yield_at == 0)
                yield_at = now + MOED_POOL_YIELD_NS;
            else if (now > yield_at)
                sched_yield();
        }
    }
    if (yield_at != 0) {
        int64_t waited = moed_pool_now_ns() - t1;
        atomic_fetch_add_explicit(&p->stat_wait_ns, (uint64_t)waited, memory_order_relaxed);
        if (waited > MOED_POOL_STALL_NS && waited > t1 - t0) {
            p->backoff = p->backoff < MOED_POOL_BACKOFF_MIN ? MOED_POOL_BACKOFF_MIN
                       : p->backoff < MOED_POOL_BACKOFF_MAX ? 2 * p->backoff : MOED_POOL_BACKOFF_MAX;
            p->solo_left = p->backoff;
            atomic_fetch_add_explicit(&p->stat_stalls, 1, memory_order_relaxed);
        } else if (p->backoff > 0) {
            p->backoff--;
        }
    } else if (p->backoff > 0) {
        p->backoff--;
    }
    atomic_fetch_add_explicit(&p->stat_jobs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->stat_chunks, n, memory_order_relaxed);
    atomic_store_explicit(&p->busy, 0, memory_order_release);
}

#endif
#endif
