/*
 * gpusim-worker: a process that looks, to NVML, psutil and /proc, like a CUDA
 * job (or like a management client) on the simulated node.
 *
 *   --state DIR         node state directory (default $GPUSIM_STATE)
 *   --gpu I             GPU index, repeatable: one context per GPU (default 0)
 *   --mib N             MiB held per GPU (default 520, a bare CUDA context)
 *   --title STR         rewrite argv so /proc/PID/cmdline reads exactly STR
 *                       (setproctitle), comm = first 15 chars
 *   --child-title STR   title of the --fork-child child (default: unchanged)
 *   --ignore-term       SIGTERM is ignored
 *   --term-delay-ms N   on SIGTERM, exit after N ms (graceful shutdown)
 *   --stop              SIGSTOP itself once ready (sits in state T)
 *   --fork-child        after creating the contexts, fork a child that keeps
 *                       them and sleeps; the parent exits (DataLoader case)
 *   --hold-only         open device files only: no contexts, no mmaps
 *   --nvml              nvmlInit() through libnvidia-ml.so.1 and get device
 *                       handles, then stay (NVML management client)
 *   --ready-fd FD       write "ready <pid>[ child <pid>]\n" there, then close
 *   --exit-after-ms N   exit by itself after N ms
 *   --kind K            compute (default), graphics or mps: the NVML process list
 *                       its contexts show in (an X/Vulkan client, an MPS client)
 *   --fork-on-term      on SIGTERM, fork a child that keeps the contexts (titled
 *                       --child-title) before exiting: a child forked during shutdown
 *   --supervise N       be a supervisor (torchrun agent, systemd Restart=) holding
 *                       no GPU: run a worker child with the other options, titled
 *                       --child-title, and start a new one --respawn-delay-ms after
 *                       each exit, N times; then exit. Ready line:
 *                       "ready <pid> worker <worker pid>". With --ignore-term the
 *                       supervisor ignores SIGTERM (its workers do not)
 *   --respawn-delay-ms N  (default 100: systemd's RestartSec)
 *   --shutdown-fd FD    a shutdown request arrives there (a line; EOF is no request:
 *                       the sender died, which a server's rank survives): exit
 *                       gracefully (SGLang's ShutdownReq, a vLLM worker's death pipe)
 *   --unlink PATH       repeatable: what the process removes itself on a graceful
 *                       exit (SIGTERM with --term-delay-ms, --exit-after-ms, a
 *                       shutdown request): the files its own teardown unlinks
 *
 * Exit status: 0 normal end, 2 usage, 3 the driver refused (OOM, lost GPU,
 * daemon not running) or the NVML client failed.
 */
#define _GNU_SOURCE
#include "worker.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nvml.h>

#define MAX_GPUS 64
#define MAX_UNLINK 32

struct options {
    const char *state;
    unsigned gpus[MAX_GPUS];
    int ngpus;
    unsigned long long mib;
    char *title;
    char *child_title;
    int ignore_term;
    long term_delay_ms;
    int stop;
    int fork_child;
    int hold_only;
    int nvml;
    int ready_fd;
    long exit_after_ms;
    const char *kind;
    int fork_on_term;
    long supervise;
    long respawn_delay_ms;
    int shutdown_fd;
    const char *unlink[MAX_UNLINK];
    int nunlink;
};

static volatile sig_atomic_t got_term;

static void on_term(int sig)
{
    (void)sig;
    got_term = 1;
}

static void usage(void)
{
    fprintf(stderr, "usage: gpusim-worker [--state DIR] [--gpu I]... [--mib N] [--title STR] [--child-title STR]\n"
                    "                     [--ignore-term] [--term-delay-ms N] [--stop] [--fork-child]\n"
                    "                     [--hold-only] [--nvml] [--ready-fd FD] [--exit-after-ms N]\n"
                    "                     [--kind compute|graphics|mps] [--fork-on-term]\n"
                    "                     [--supervise N [--respawn-delay-ms N]]\n"
                    "                     [--shutdown-fd FD] [--unlink PATH]...\n");
    exit(WK_EXIT_USAGE);
}

static long num_arg(const char *opt, const char *val)
{
    char *end;
    long v;
    if (!val)
        usage();
    v = strtol(val, &end, 10);
    if (*end || v < 0) {
        fprintf(stderr, "gpusim-worker: %s needs a non-negative integer, not '%s'\n", opt, val);
        exit(WK_EXIT_USAGE);
    }
    return v;
}

static void parse(int argc, char **argv, struct options *o)
{
    memset(o, 0, sizeof *o);
    o->state = getenv("GPUSIM_STATE");
    o->mib = 520;
    o->term_delay_ms = -1;
    o->ready_fd = -1;
    o->exit_after_ms = -1;
    o->kind = "compute";
    o->supervise = -1;
    o->respawn_delay_ms = 100;
    o->shutdown_fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--state") == 0 && v)
            o->state = argv[++i];
        else if (strcmp(a, "--gpu") == 0) {
            long g = num_arg(a, v);
            i++;
            if (o->ngpus < MAX_GPUS)
                o->gpus[o->ngpus++] = (unsigned)g;
        } else if (strcmp(a, "--mib") == 0)
            o->mib = (unsigned long long)num_arg(a, v), i++;
        else if (strcmp(a, "--title") == 0 && v)
            o->title = strdup(argv[++i]);
        else if (strcmp(a, "--child-title") == 0 && v)
            o->child_title = strdup(argv[++i]);
        else if (strcmp(a, "--ignore-term") == 0)
            o->ignore_term = 1;
        else if (strcmp(a, "--term-delay-ms") == 0)
            o->term_delay_ms = num_arg(a, v), i++;
        else if (strcmp(a, "--stop") == 0)
            o->stop = 1;
        else if (strcmp(a, "--fork-child") == 0)
            o->fork_child = 1;
        else if (strcmp(a, "--hold-only") == 0)
            o->hold_only = 1;
        else if (strcmp(a, "--nvml") == 0)
            o->nvml = 1;
        else if (strcmp(a, "--ready-fd") == 0)
            o->ready_fd = (int)num_arg(a, v), i++;
        else if (strcmp(a, "--exit-after-ms") == 0)
            o->exit_after_ms = num_arg(a, v), i++;
        else if (strcmp(a, "--kind") == 0 && v) {
            if (strcmp(v, "compute") && strcmp(v, "graphics") && strcmp(v, "mps")) {
                fprintf(stderr, "gpusim-worker: --kind is compute, graphics or mps, not '%s'\n", v);
                exit(WK_EXIT_USAGE);
            }
            o->kind = argv[++i];
        } else if (strcmp(a, "--fork-on-term") == 0)
            o->fork_on_term = 1;
        else if (strcmp(a, "--supervise") == 0)
            o->supervise = num_arg(a, v), i++;
        else if (strcmp(a, "--respawn-delay-ms") == 0)
            o->respawn_delay_ms = num_arg(a, v), i++;
        else if (strcmp(a, "--shutdown-fd") == 0)
            o->shutdown_fd = (int)num_arg(a, v), i++;
        else if (strcmp(a, "--unlink") == 0 && v) {
            if (o->nunlink < MAX_UNLINK)
                o->unlink[o->nunlink++] = strdup(argv[i + 1]);
            i++;
        }
        else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
            usage();
        else {
            fprintf(stderr, "gpusim-worker: unknown or incomplete option '%s'\n", a);
            usage();
        }
    }
    if (!o->state || !o->state[0]) {
        fprintf(stderr, "gpusim-worker: no state directory (--state or GPUSIM_STATE)\n");
        exit(WK_EXIT_USAGE);
    }
    o->state = strdup(o->state); /* the argv area is rewritten by --title */
    o->kind = strdup(o->kind);
}

static void fail(const char *fmt, const char *detail)
{
    fprintf(stderr, "gpusim-worker: ");
    fprintf(stderr, fmt, detail);
    fputc('\n', stderr);
    exit(WK_EXIT_DRIVER);
}

/* Management client without NVML: hold the device files, map nothing. With no
 * --gpu, every dev/nvidia<N> (like nvidia-persistenced). */
static void hold_devices(const struct options *o)
{
    char name[32];
    if (wk_open_device(o->state, "nvidiactl", 0) < 0)
        fail("cannot open %s/dev/nvidiactl", o->state);
    wk_open_device(o->state, "nvidia-uvm", 0);
    if (o->ngpus) {
        for (int i = 0; i < o->ngpus; i++) {
            int minor = wk_gpu_minor(o->state, o->gpus[i]);
            snprintf(name, sizeof name, "nvidia%d", minor < 0 ? (int)o->gpus[i] : minor);
            if (wk_open_device(o->state, name, 0) < 0)
                fail("cannot open device %s", name);
        }
        return;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s", wk_dev_dir(o->state));
    DIR *d = opendir(path);
    struct dirent *de;
    if (!d)
        fail("cannot open %s", path);
    while ((de = readdir(d)) != NULL) {
        unsigned minor;
        char tail;
        if (sscanf(de->d_name, "nvidia%u%c", &minor, &tail) == 1)
            wk_open_device(o->state, de->d_name, 0);
    }
    closedir(d);
}

/* NVML management client: the library itself opens what it opens. */
static void nvml_client(const struct options *o)
{
    __typeof__(&nvmlInit_v2) init;
    __typeof__(&nvmlDeviceGetCount_v2) count;
    __typeof__(&nvmlDeviceGetHandleByIndex_v2) handle;
    __typeof__(&nvmlErrorString) errstr;
    nvmlDevice_t dev;
    nvmlReturn_t rc;
    unsigned n = 0;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);

    if (!lib)
        fail("cannot load libnvidia-ml.so.1: %s", dlerror());
    *(void **)&init = dlsym(lib, "nvmlInit_v2");
    *(void **)&count = dlsym(lib, "nvmlDeviceGetCount_v2");
    *(void **)&handle = dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&errstr = dlsym(lib, "nvmlErrorString");
    if (!init || !count || !handle || !errstr)
        fail("%s", "libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetCount_v2/nvmlDeviceGetHandleByIndex_v2");
    if ((rc = init()) != NVML_SUCCESS)
        fail("nvmlInit: %s", errstr(rc));
    if (o->ngpus) {
        for (int i = 0; i < o->ngpus; i++)
            if ((rc = handle(o->gpus[i], &dev)) != NVML_SUCCESS)
                fail("nvmlDeviceGetHandleByIndex: %s", errstr(rc));
    } else if (count(&n) == NVML_SUCCESS) {
        for (unsigned i = 0; i < n; i++)
            handle(i, &dev); /* a lost GPU just stays unattached */
    }
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void idle(const struct options *o);

/* A graceful exit: remove what the process's own teardown removes, then exit (its contexts
 * are torn down in the driver as the process exits, as ever). */
static void graceful_exit(const struct options *o)
{
    for (int i = 0; i < o->nunlink; i++)
        if (unlink(o->unlink[i]) < 0 && errno != ENOENT)
            fprintf(stderr, "gpusim-worker: unlink %s: %s\n", o->unlink[i], strerror(errno));
    exit(0);
}

/* A child forked during shutdown (a cache flusher, a multiprocessing helper): it inherits the
 * open device files, hence the contexts, and outlives the parent. */
static void fork_on_term(const struct options *o)
{
    pid_t pid;
    fflush(NULL);
    pid = fork();
    if (pid != 0)
        return;
    struct options child = *o;
    sigset_t none;
    signal(SIGTERM, SIG_DFL);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    got_term = 0;
    child.fork_on_term = 0;
    child.term_delay_ms = -1;
    child.exit_after_ms = -1;
    if (child.ready_fd >= 0)
        close(child.ready_fd);
    child.ready_fd = -1;
    if (o->child_title)
        wk_set_proctitle(o->child_title);
    idle(&child);
    exit(0);
}

/* Sleep until SIGTERM (if handled), the exit deadline, a shutdown request or forever. */
static void idle(const struct options *o)
{
    sigset_t unblocked;
    long long deadline = o->exit_after_ms >= 0 ? now_ms() + o->exit_after_ms : -1;
    struct pollfd pfd = {o->shutdown_fd, POLLIN, 0};

    sigprocmask(SIG_SETMASK, NULL, &unblocked);
    sigdelset(&unblocked, SIGTERM);
    for (;;) {
        struct timespec ts, *tsp = NULL;
        if (got_term) {
            if (o->fork_on_term)
                fork_on_term(o);
            if (o->term_delay_ms > 0)
                sleep_ms(o->term_delay_ms);
            graceful_exit(o);
        }
        if (deadline >= 0) {
            long long left = deadline - now_ms();
            if (left <= 0)
                graceful_exit(o);
            ts.tv_sec = left / 1000;
            ts.tv_nsec = (left % 1000) * 1000000L;
            tsp = &ts;
        }
        /* ppoll atomically unblocks SIGTERM while waiting: no lost wake-up. */
        if (ppoll(pfd.fd >= 0 ? &pfd : NULL, pfd.fd >= 0 ? 1 : 0, tsp, &unblocked) > 0 && pfd.revents) {
            char buf[64];
            ssize_t n = read(pfd.fd, buf, sizeof buf);
            if (n > 0)
                graceful_exit(o); /* the shutdown request */
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
                close(pfd.fd); /* its sender is gone: no request will come */
                pfd.fd = -1;
            }
        }
    }
}

static void report_ready(struct options *o, pid_t child)
{
    char line[64];
    int n;
    if (o->ready_fd < 0)
        return;
    if (child > 0)
        n = snprintf(line, sizeof line, "ready %d child %d\n", (int)getpid(), (int)child);
    else
        n = snprintf(line, sizeof line, "ready %d\n", (int)getpid());
    if (write(o->ready_fd, line, (size_t)n) < 0)
        perror("gpusim-worker: ready-fd");
    close(o->ready_fd);
    o->ready_fd = -1;
}

/* The worker proper: contexts (or device files / NVML), then ready, then idle. `notify` is a
 * pipe to a supervisor (written once the contexts exist) or -1. */
static int run_worker(struct options *o, int notify)
{
    char err[512];
    unsigned ids[MAX_GPUS];
    int nids = 0;
    pid_t child = 0;

    if (o->ignore_term)
        signal(SIGTERM, SIG_IGN);
    else if (o->term_delay_ms >= 0 || o->fork_on_term) {
        sigset_t block;
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_term;
        sigaction(SIGTERM, &sa, NULL);
        sigemptyset(&block);
        sigaddset(&block, SIGTERM);
        sigprocmask(SIG_BLOCK, &block, NULL); /* delivered only inside ppoll */
    }

    if (o->hold_only || o->nvml) {
        if (o->hold_only)
            hold_devices(o);
        if (o->nvml)
            nvml_client(o);
    } else {
        if (!o->ngpus)
            o->gpus[o->ngpus++] = 0;
        for (int i = 0; i < o->ngpus; i++) {
            int dup = 0, id;
            for (int j = 0; j < i; j++)
                dup |= o->gpus[j] == o->gpus[i];
            if (dup)
                continue;
            id = wk_create_context(o->state, o->gpus[i], o->mib, o->kind, err, sizeof err);
            if (id < 0) {
                fprintf(stderr, "gpusim-worker: GPU %u: %s\n", o->gpus[i], err);
                return WK_EXIT_DRIVER;
            }
            ids[nids++] = (unsigned)id;
        }
        wk_open_teardown(o->state, ids, nids); /* kept open until exit, on purpose */
    }

    if (o->fork_child) {
        int sync[2];
        char byte = 0;
        fflush(NULL);
        if (pipe2(sync, O_CLOEXEC) < 0 || (child = fork()) < 0) {
            perror("gpusim-worker: fork");
            return 1;
        }
        if (child == 0) {
            /* The child inherits the open device files, hence the contexts. */
            close(sync[0]);
            if (o->ready_fd >= 0)
                close(o->ready_fd);
            o->ready_fd = -1;
            if (notify >= 0)
                close(notify);
            if (o->child_title)
                wk_set_proctitle(o->child_title);
            close(sync[1]); /* set up: the parent may report ready */
            if (o->stop)
                raise(SIGSTOP);
            idle(o);
        }
        close(sync[1]);
        while (read(sync[0], &byte, 1) < 0 && errno == EINTR)
            ;
        close(sync[0]);
        report_ready(o, child);
        if (notify >= 0 && write(notify, "r", 1) < 0)
            perror("gpusim-worker: notify");
        printf("%d\n", (int)child);
        return 0;
    }

    report_ready(o, 0);
    if (notify >= 0) {
        if (write(notify, "r", 1) < 0)
            perror("gpusim-worker: notify");
        close(notify);
    }
    if (o->stop)
        raise(SIGSTOP);
    idle(o);
    return 0;
}

/* --supervise N: hold nothing, keep a worker running, restart it N times after it ends. */
static int supervise(struct options *o)
{
    long restarts = 0;
    int first = 1;
    int ignore = o->ignore_term;
    o->ignore_term = 0; /* for the workers */
    if (ignore)
        signal(SIGTERM, SIG_IGN);
    for (;;) {
        int sync[2], status;
        char byte;
        ssize_t n;
        pid_t pid;
        fflush(NULL);
        if (pipe2(sync, O_CLOEXEC) < 0 || (pid = fork()) < 0) {
            perror("gpusim-worker: supervise");
            return 1;
        }
        if (pid == 0) {
            close(sync[0]);
            if (o->ready_fd >= 0)
                close(o->ready_fd);
            o->ready_fd = -1;
            o->supervise = -1;
            signal(SIGTERM, SIG_DFL);
            if (o->child_title)
                wk_set_proctitle(o->child_title);
            exit(run_worker(o, sync[1]));
        }
        close(sync[1]);
        while ((n = read(sync[0], &byte, 1)) < 0 && errno == EINTR)
            ;
        close(sync[0]);
        if (first) {
            char line[64];
            int len;
            if (n != 1) {
                fprintf(stderr, "gpusim-worker: the supervised worker failed to start\n");
                waitpid(pid, &status, 0);
                return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
            }
            first = 0;
            if (o->ready_fd >= 0) {
                len = snprintf(line, sizeof line, "ready %d worker %d\n", (int)getpid(), (int)pid);
                if (write(o->ready_fd, line, (size_t)len) < 0)
                    perror("gpusim-worker: ready-fd");
                close(o->ready_fd);
                o->ready_fd = -1;
            }
        }
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (restarts >= o->supervise)
            return 0; /* gave up, as torchrun does after --max-restarts */
        restarts++;
        sleep_ms(o->respawn_delay_ms);
    }
}

int main(int argc, char **argv)
{
    struct options o;

    parse(argc, argv, &o);
    wk_proctitle_init(argc, argv);
    if (o.title)
        wk_set_proctitle(o.title);
    if (o.supervise >= 0)
        return supervise(&o);
    return run_worker(&o, -1);
}
