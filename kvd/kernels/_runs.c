/*
 * kvd's CPU post-process kernel: execute a plan's byte runs over groups of pages, in place.
 *
 * A group is the pages one NIXL READ filled (kvd/layout/planner.py). Every group gets the same
 * plan: runs (dst_in_group, src_page, src_offset, nbytes) copy landed bytes, or write zeros
 * (src_page -1), into a private scratch copy of the group that stays in cache; then the ranges
 * the runs wrote go back to the pages. So every byte that moves is read once and written once
 * in main memory; bytes the plan leaves in place are not touched at all. The runs come in
 * destination order, or in source order where that scatters over fewer streams (gather_order
 * in kvd/kernels/cpu.py: the hardware prefetchers follow a few streams, not dozens). The
 * write-back uses ordinary stores: the gather has just pulled every line into cache, so they
 * hit there.
 * (Non-temporal stores, which skip the cache, made the kernel 1.2 to 1.4 times slower.)
 *
 * Memory faults: the pages are the engine's, mapped from a file it may truncate, and a touch
 * past the end of a file raises SIGBUS. Each worker arms a sigjmp_buf (pointed to from a
 * thread-local) while it touches pages; a SIGBUS or SIGSEGV handler jumps back to it when the
 * faulting thread is inside the kernel, and otherwise hands the signal on to whoever handled
 * it before. The call then returns the fault instead of killing the process.
 *
 * The Python wrapper (kvd/kernels/cpu.py) forms every address from checked block ids; this
 * file trusts its arguments. No Python object is touched while the GIL is released.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* Faults */

typedef struct {
    sigjmp_buf jump;
    int signal;
    uintptr_t address;
} fault_t;

/* The fault context of the kernel work this thread is doing, or NULL. Initial-exec TLS: the
 * handler may run in any thread, and reading dynamic TLS there could allocate. */
static __thread fault_t *volatile armed __attribute__((tls_model("initial-exec")));

static const int fault_signals[2] = {SIGBUS, SIGSEGV};
static struct sigaction previous[2];

static void on_fault(int signo, siginfo_t *info, void *context) {
    fault_t *fault = armed;
    if (fault != NULL) {
        armed = NULL;
        fault->signal = signo;
        fault->address = (uintptr_t)info->si_addr;
        siglongjmp(fault->jump, 1);
    }
    const struct sigaction *prev = &previous[signo == SIGBUS ? 0 : 1];
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction != NULL) {
            prev->sa_sigaction(signo, info, context);
            return;
        }
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(signo);
        return;
    }
    if (info->si_code <= 0 && prev->sa_handler == SIG_IGN) {
        return; /* sent by kill() and ignored before us */
    }
    /* The default action: restore it and let the fault happen again (or re-send a signal
     * that came from kill(), which returning would not repeat). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(signo, &dfl, NULL);
    if (info->si_code <= 0) {
        raise(signo);
    }
}

/* Put our handler first. Called at each kernel call: someone (Python's faulthandler, say) may
 * have installed theirs since; theirs becomes the one we hand foreign faults to. */
static int install_fault_handlers(void) {
    for (int i = 0; i < 2; i++) {
        struct sigaction current;
        if (sigaction(fault_signals[i], NULL, &current) != 0) return -1;
        if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_fault) continue;
        struct sigaction mine;
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = on_fault;
        mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&mine.sa_mask);
        previous[i] = current;
        if (sigaction(fault_signals[i], &mine, NULL) != 0) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The work */

typedef struct {
    const int64_t *pages;      /* n_groups * pages_per_group page addresses */
    int64_t n_groups;
    int64_t pages_per_group;
    int64_t page_bytes;
    int64_t group_bytes;       /* pages_per_group * page_bytes: one worker's scratch */
    const int64_t *runs;       /* (dst_in_group, src_page or -1, src_offset, nbytes) */
    int64_t n_runs;
    const int64_t *write_back; /* (offset_in_group, nbytes), none straddling a page */
    int64_t n_write_back;
    int64_t prefetch;          /* runs ahead to prefetch the source of; 0: none */
    int64_t chunk;             /* groups a worker takes at a time */
    int64_t next;              /* the first group no worker has taken (atomic) */
} job_t;

typedef struct {
    job_t *job;
    int out_of_memory;
    fault_t fault;             /* signal 0: none */
} work_t;

/* Groups at least this many bytes per take: the shared counter is touched rarely. */
#define CHUNK_BYTES (256 << 10)

/* Constant sizes let the compiler inline the copy as a few vector moves: runs of one head_dim
 * row are far too short to amortise a call into libc's memcpy. */
static inline void copy_bytes(char *dst, const char *src, size_t n) {
    switch (n) {
    case 16: memcpy(dst, src, 16); break;
    case 32: memcpy(dst, src, 32); break;
    case 64: memcpy(dst, src, 64); break;
    case 128: memcpy(dst, src, 128); break;
    case 256: memcpy(dst, src, 256); break;
    case 512: memcpy(dst, src, 512); break;
    default: memcpy(dst, src, n);
    }
}

/* Runs read the landed pages out of order (that is the point), which defeats the hardware
 * prefetchers when runs are strided: ask for the source of the run `prefetch` runs ahead. */
#define PREFETCH_BYTES 512

/* One group: gather its moves into scratch, then copy the written ranges back. */
static void run_group(const job_t *job, char *const *pages, char *scratch) {
    const int64_t page_bytes = job->page_bytes, prefetch = job->prefetch;
    for (int64_t r = 0; r < job->n_runs; r++) {
        const int64_t *run = job->runs + 4 * r;
        if (prefetch && r + prefetch < job->n_runs) {
            const int64_t *ahead = run + 4 * prefetch;
            if (ahead[1] >= 0) {
                const char *p = pages[ahead[1]] + ahead[2];
                int64_t n = ahead[3] < PREFETCH_BYTES ? ahead[3] : PREFETCH_BYTES;
                for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
            }
        }
        if (run[1] < 0) {
            memset(scratch + run[0], 0, (size_t)run[3]);
        } else {
            copy_bytes(scratch + run[0], pages[run[1]] + run[2], (size_t)run[3]);
        }
    }
    for (int64_t r = 0; r < job->n_write_back; r++) {
        const int64_t *range = job->write_back + 2 * r;
        int64_t page = range[0] / page_bytes;
        memcpy(pages[page] + (range[0] - page * page_bytes), scratch + range[0],
               (size_t)range[1]);
    }
}

/* Workers take chunks of groups from a shared counter rather than a fixed share each: a call
 * is as slow as its slowest worker, and a core that something else is using (the engine, a
 * neighbour, a hypervisor) would otherwise hold up the whole call. */
static void run_groups(job_t *job, char *scratch) {
    for (;;) {
        int64_t first = __atomic_fetch_add(&job->next, job->chunk, __ATOMIC_RELAXED);
        if (first >= job->n_groups) return;
        int64_t last = first + job->chunk < job->n_groups ? first + job->chunk : job->n_groups;
        for (int64_t g = first; g < last; g++) {
            run_group(job, (char *const *)(job->pages + g * job->pages_per_group), scratch);
        }
    }
}

static void *run_worker(void *arg) {
    work_t *w = (work_t *)arg;
    job_t *job = w->job;
    /* Cache-line aligned: the write-back reads it line by line. */
    char *scratch = aligned_alloc(64, (size_t)(job->group_bytes + 63) / 64 * 64);
    if (scratch == NULL) {
        w->out_of_memory = 1;
        return NULL;
    }
    w->fault.signal = 0;
    if (sigsetjmp(w->fault.jump, 1) == 0) {
        armed = &w->fault;
        run_groups(job, scratch);
        armed = NULL;
    }
    free(scratch);
    return NULL;
}

#define MAX_THREADS 64

static PyObject *apply_runs(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pages, runs, write_back;
    long long n_groups, pages_per_group, page_bytes, n_runs, n_write_back, prefetch;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLLKLKLLi", &pages, &n_groups, &pages_per_group, &page_bytes,
                          &runs, &n_runs, &write_back, &n_write_back, &prefetch, &threads)) {
        return NULL;
    }
    if (n_groups < 0 || pages_per_group < 1 || page_bytes < 1 || n_runs < 0 ||
        n_write_back < 0 || prefetch < 0) {
        PyErr_SetString(PyExc_ValueError, "apply_runs: bad counts or sizes");
        return NULL;
    }
    if (n_groups == 0 || (n_runs == 0 && n_write_back == 0)) {
        Py_RETURN_NONE;
    }
    if (install_fault_handlers() != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (n_groups < threads) threads = (int)n_groups;

    int64_t group_bytes = pages_per_group * page_bytes;
    job_t job = {
        .pages = (const int64_t *)(uintptr_t)pages, .n_groups = n_groups,
        .pages_per_group = pages_per_group, .page_bytes = page_bytes, .group_bytes = group_bytes,
        .runs = (const int64_t *)(uintptr_t)runs, .n_runs = n_runs,
        .write_back = (const int64_t *)(uintptr_t)write_back, .n_write_back = n_write_back,
        .prefetch = prefetch, .chunk = group_bytes >= CHUNK_BYTES ? 1 : CHUNK_BYTES / group_bytes,
        .next = 0,
    };
    work_t work[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        work[t] = (work_t){.job = &job};
    }
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tids[t], NULL, run_worker, &work[t]) == 0;
        if (!started[t]) run_worker(&work[t]); /* no thread: do its share here */
    }
    run_worker(&work[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
    }
    Py_END_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        if (work[t].fault.signal) {
            return Py_BuildValue("(iK)", work[t].fault.signal,
                                 (unsigned long long)work[t].fault.address);
        }
    }
    for (int t = 0; t < threads; t++) {
        if (work[t].out_of_memory) return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"apply_runs", apply_runs, METH_VARARGS,
     "apply_runs(pages, n_groups, pages_per_group, page_bytes, runs, n_runs, write_back,\n"
     "           n_write_back, prefetch, threads)\n"
     "Apply a plan in place to every group of pages. pages, runs and write_back are addresses\n"
     "of int64 arrays: page addresses (n_groups x pages_per_group), runs (dst_in_group,\n"
     "src_page or -1 for zeros, src_offset, nbytes) and write-back ranges (offset_in_group,\n"
     "nbytes). prefetch: how many runs ahead to prefetch sources (0: none). Returns None, or (signal, address) when a page faulted (SIGBUS: its file was\n"
     "truncated). The GIL is released while bytes move."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_runs", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__runs(void) { return PyModule_Create(&module); }
