/*
 * Context records: which GPU memory is held, by whom, and until when.
 *
 * The daemon (gpusim.driver) writes one record per context into ctx/ and
 * updates it atomically (rename) when the holders are gone: it then carries
 * release_ns, the CLOCK_MONOTONIC time at which the "driver" has finished
 * tearing the context down. A context counts (memory used and listed as a
 * process) while it has no release_ns, or until release_ns has passed.
 *
 * If the daemon is not running (nobody holds the OFD lock on driver.lock), a
 * record without release_ns is checked directly: the owner holds an OFD read
 * lock on the context's byte of dev/nvidia<minor>; if no such lock exists any
 * more, every holder has closed the device and the context is gone.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long long sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Is there an OFD lock (of anyone but this open file) on byte `off` of fd? */
static int byte_locked(int fd, off_t off)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = off;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) < 0)
        return 1; /* cannot tell: assume the context is still alive */
    return fl.l_type != F_UNLCK;
}

/* The daemon holds an OFD write lock on byte 0 of driver.lock while it runs.
 * A lock (unlike a pid file) reads the same from every PID namespace. */
static int daemon_running(void)
{
    char path[PATH_MAX + 16];
    int fd, alive;
    snprintf(path, sizeof path, "%s/driver.lock", sim_state);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    alive = byte_locked(fd, 0);
    close(fd);
    return alive;
}

/* Does some process still hold the context's lock byte on its GPU's device file? */
static int context_held(unsigned gpu, off_t lock)
{
    char path[PATH_MAX + 32];
    int fd, held;
    if (gpu < SIM_MAX_GPUS && sim_devices[gpu].fd >= 0)
        return byte_locked(sim_devices[gpu].fd, lock);
    /* driver/ holds hard links of the device files: the same inodes, hence the same locks. */
    snprintf(path, sizeof path, "%s/driver/nvidia%u", sim_state, sim_cfg.gpus[gpu].minor);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    held = byte_locked(fd, lock);
    close(fd);
    return held;
}

static void parse_levels(sim_ctx_t *c, const char *s)
{
    c->nlevels = 0;
    while (*s && c->nlevels < SIM_MAX_LEVELS) {
        char *end;
        unsigned long long ns = strtoull(s, &end, 10);
        unsigned long pid;
        if (end == s || *end != ':')
            break;
        s = end + 1;
        pid = strtoul(s, &end, 10);
        if (end == s)
            break;
        c->level_ns[c->nlevels] = ns;
        c->level_pid[c->nlevels] = (unsigned)pid;
        c->nlevels++;
        s = end;
        if (*s == ',')
            s++;
    }
}

/* Parse one record. Returns 1 if it is for `gpu` and must be evaluated. */
static int read_record(int dirfd, const char *name, unsigned gpu, sim_ctx_t *c, long long *release_ns,
                       long long *lock)
{
    char buf[2048];
    char *line, *save = NULL;
    ssize_t n;
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
    int have_gpu = 0;
    if (fd < 0)
        return 0; /* deleted between readdir and open: released */
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    memset(c, 0, sizeof *c);
    *release_ns = 0;
    *lock = -1;
    for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        if (!eq)
            continue;
        *eq++ = '\0';
        if (strcmp(line, "id") == 0)
            c->id = (unsigned)strtoul(eq, NULL, 10);
        else if (strcmp(line, "gpu") == 0) {
            c->gpu = (unsigned)strtoul(eq, NULL, 10);
            have_gpu = 1;
        } else if (strcmp(line, "mib") == 0)
            c->mib = strtoull(eq, NULL, 10);
        else if (strcmp(line, "lock") == 0)
            *lock = strtoll(eq, NULL, 10);
        else if (strcmp(line, "levels") == 0)
            parse_levels(c, eq);
        else if (strcmp(line, "release_ns") == 0 && eq[0])
            *release_ns = strtoll(eq, NULL, 10);
        else if (strcmp(line, "kind") == 0)
            c->kind = strcmp(eq, "graphics") == 0 ? 1 : strcmp(eq, "mps") == 0 ? 2 : 0;
    }
    return have_gpu && c->gpu == gpu;
}

static int by_id(const void *a, const void *b)
{
    const sim_ctx_t *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

/* Fill out[] with the contexts of `gpu` that currently count, sorted by id.
 * Returns how many there are (possibly more than max; only max are stored). */
int sim_ctx_scan(unsigned gpu, sim_ctx_t *out, int max)
{
    char path[PATH_MAX + 16];
    DIR *dir;
    struct dirent *de;
    long long now = sim_now_ns();
    int count = 0;
    int daemon = -1; /* evaluated lazily: only records without release_ns need it */

    snprintf(path, sizeof path, "%s/ctx", sim_state);
    dir = opendir(path);
    if (!dir)
        return 0;
    while ((de = readdir(dir)) != NULL) {
        sim_ctx_t c;
        long long release_ns, lock;
        size_t len = strlen(de->d_name);
        if (de->d_name[0] == '.' || len < 5 || strcmp(de->d_name + len - 4, ".ctx") != 0)
            continue;
        if (!read_record(dirfd(dir), de->d_name, gpu, &c, &release_ns, &lock))
            continue;
        if (release_ns) {
            if (now >= release_ns)
                continue;
        } else {
            if (daemon < 0)
                daemon = daemon_running();
            if (!daemon && lock >= 0 && !context_held(gpu, (off_t)lock))
                continue;
        }
        if (count < max)
            out[count] = c;
        count++;
    }
    closedir(dir);
    qsort(out, (size_t)(count < max ? count : max), sizeof *out, by_id);
    return count;
}

/* Device memory held by contexts of `gpu` (no namespace filtering, as in RM): what the
 * processes are charged plus the driver's own overhead per context, which no process is. */
unsigned long long sim_ctx_used_mib(unsigned gpu)
{
    static sim_ctx_t ctx[SIM_MAX_CTX];
    unsigned long long sum = 0;
    int n = sim_ctx_scan(gpu, ctx, SIM_MAX_CTX);
    for (int i = 0; i < n && i < SIM_MAX_CTX; i++)
        sum += ctx[i].mib + sim_cfg.context_overhead_mib;
    return sum;
}

/* The owner's pid as the caller should see it (driver >= 535.113: converted
 * into the caller's PID namespace, dropped if not visible there; with the
 * legacy_pids fault: the outermost pid, unconverted). Returns 0 if invisible. */
int sim_ctx_visible_pid(const sim_ctx_t *ctx, unsigned *pid)
{
    if (ctx->nlevels == 0)
        return 0;
    if (sim_cfg.legacy_pids) {
        *pid = ctx->level_pid[0];
        return 1;
    }
    for (int i = 0; i < ctx->nlevels; i++) {
        if (ctx->level_ns[i] == sim_caller_pidns) {
            *pid = ctx->level_pid[i];
            return 1;
        }
    }
    return 0;
}
