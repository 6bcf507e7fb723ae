/*
 * The worker's side of the simulated driver: device files and contexts.
 *
 * A CUDA process opens /dev/nvidiactl, /dev/nvidia-uvm and the /dev/nvidia<N>
 * of every GPU, and maps them; the GPU memory it allocates belongs to the open file, so it
 * lives as long as any process holds that open file description (a forked
 * child keeps it after its parent dies). We reproduce exactly that with an
 * OFD lock: the context is a read lock on byte <id> of dev/nvidia<minor>,
 * taken through the worker's own open file. OFD locks are owned by the open
 * file description, survive fork and vanish when its last fd is closed, which
 * is what the daemon waits for.
 *
 * Registration, over the daemon's unix socket:
 *   -> "register <gpu> <mib>"      <- "lock <id> <minor>" | "error <CODE> <text>"
 *   (take the OFD lock on byte <id>)
 *   -> "locked"                     <- "ok <id>"            | "error <CODE> <text>"
 * The daemon learns our pid from SO_PEERCRED, so nothing is claimed by us.
 */
#define _GNU_SOURCE
#include "worker.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define MAP_BYTES 4096

/* Where the device files are: $GPUSIM_DEV_DIR (a node published under /dev), else
 * $state/dev. The daemon's hard links in $state/driver are the same inodes. */
const char *wk_dev_dir(const char *state)
{
    static char dir[PATH_MAX];
    const char *env = getenv("GPUSIM_DEV_DIR");
    if (env && env[0])
        snprintf(dir, sizeof dir, "%s", env);
    else
        snprintf(dir, sizeof dir, "%s/dev", state);
    return dir;
}

/* Read node.conf and return the integer value of `key`, or -1. */
static long conf_long(const char *state, const char *key)
{
    char path[PATH_MAX], line[512];
    size_t klen = strlen(key);
    long value = -1;
    FILE *f;
    snprintf(path, sizeof path, "%s/node.conf", state);
    f = fopen(path, "re");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            value = strtol(line + klen + 1, NULL, 0);
            break;
        }
    }
    fclose(f);
    return value;
}

int wk_gpu_minor(const char *state, unsigned gpu)
{
    char key[64];
    snprintf(key, sizeof key, "gpu.%u.minor", gpu);
    return (int)conf_long(state, key);
}

int wk_gpu_count(const char *state)
{
    return (int)conf_long(state, "gpu_count");
}

/* Open $state/dev/<name> (once per name) and, for a CUDA-like process, map it:
 * management clients hold fds only, compute processes also have mappings. */
int wk_open_device(const char *state, const char *name, int map)
{
    static struct {
        char name[32];
        int fd;
        int mapped;
    } open_devs[80];
    static int n_open;
    char path[PATH_MAX];
    int i, fd;

    for (i = 0; i < n_open && strcmp(open_devs[i].name, name) != 0; i++)
        ;
    if (i == n_open) {
        if (n_open == (int)(sizeof open_devs / sizeof open_devs[0]))
            return -1;
        snprintf(path, sizeof path, "%s/%s", wk_dev_dir(state), name);
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            return -1;
        snprintf(open_devs[i].name, sizeof open_devs[i].name, "%s", name);
        open_devs[i].fd = fd;
        open_devs[i].mapped = 0;
        n_open++;
    }
    if (map && !open_devs[i].mapped) {
        /* A real character device node (gpusim makes them where mknod is allowed) stands on
         * /dev/zero's driver: a shared mapping of it would become anonymous shared memory
         * ("/dev/zero (deleted)"), a private one keeps the node's path in /proc/PID/maps,
         * as the NVIDIA driver's mappings do. Regular files are mapped shared, like the driver. */
        struct stat st;
        int flags = fstat(open_devs[i].fd, &st) == 0 && S_ISCHR(st.st_mode) ? MAP_PRIVATE : MAP_SHARED;
        if (mmap(NULL, MAP_BYTES, PROT_READ | PROT_WRITE, flags, open_devs[i].fd, 0) == MAP_FAILED)
            return -1;
        open_devs[i].mapped = 1;
    }
    return open_devs[i].fd;
}

static int send_line(int sock, const char *line)
{
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t n = send(sock, line + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        off += (size_t)n;
    }
    return 0;
}

/* Read one '\n'-terminated line (without the newline). */
static int recv_line(int sock, char *buf, size_t size)
{
    size_t len = 0;
    while (len + 1 < size) {
        ssize_t n = recv(sock, buf + len, 1, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        if (buf[len] == '\n')
            break;
        len++;
    }
    buf[len] = '\0';
    return 0;
}

static int driver_connect(const char *state, char *err, size_t errlen)
{
    struct sockaddr_un sa;
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/driver.sock", state) >= (int)sizeof sa.sun_path) {
        snprintf(err, errlen, "state path too long for a unix socket: %s", state);
        close(sock);
        return -1;
    }
    if (sock < 0 || connect(sock, (struct sockaddr *)&sa, sizeof sa) < 0) {
        snprintf(err, errlen, "driver daemon not running (%s: %s)", sa.sun_path, strerror(errno));
        if (sock >= 0)
            close(sock);
        return -1;
    }
    return sock;
}

/* "error OOM text" -> "text" into err, and "OOM" into wk_last_code (the daemon's word for the failure,
 * which the simulated libcuda turns into a CUresult). */
char wk_last_code[32];

static void driver_error(const char *reply, char *err, size_t errlen)
{
    const char *text = reply;
    snprintf(wk_last_code, sizeof wk_last_code, "%s", "DRIVER");
    if (strncmp(reply, "error ", 6) == 0) {
        const char *space = strchr(reply + 6, ' ');
        size_t n = space ? (size_t)(space - (reply + 6)) : strlen(reply + 6);
        snprintf(wk_last_code, sizeof wk_last_code, "%.*s", (int)(n < sizeof wk_last_code ? n : sizeof wk_last_code - 1), reply + 6);
        text = space ? space + 1 : reply + 6;
    }
    snprintf(err, errlen, "%s", text[0] ? text : "driver daemon closed the connection");
}

/* One request to the daemon ("alloc 7 2048", "release 7", "meminfo 3"), its one-line answer into reply.
 * Returns 0 when the answer starts with "ok", -1 otherwise (err and wk_last_code say why). */
int wk_request(const char *state, const char *request, char *reply, size_t replylen, char *err, size_t errlen)
{
    char line[512];
    int sock = driver_connect(state, err, errlen);
    if (sock < 0) {
        snprintf(wk_last_code, sizeof wk_last_code, "%s", "NODAEMON");
        return -1;
    }
    snprintf(line, sizeof line, "%s\n", request);
    if (send_line(sock, line) < 0 || recv_line(sock, reply, replylen) < 0) {
        snprintf(err, errlen, "driver daemon closed the connection");
        snprintf(wk_last_code, sizeof wk_last_code, "%s", "DRIVER");
        close(sock);
        return -1;
    }
    close(sock);
    if (strncmp(reply, "ok", 2) != 0) {
        driver_error(reply, err, errlen);
        return -1;
    }
    return 0;
}

/* Create one context of `mib` MiB on GPU index `gpu` (kind: compute, graphics or mps: the
 * NVML process list it shows in). Returns the context id, or -1 with a message in err. */
int wk_create_context(const char *state, unsigned gpu, unsigned long long mib, const char *kind, char *err, size_t errlen)
{
    char line[512];
    unsigned id, minor;
    char devname[32];
    struct flock fl;
    int sock, fd;

    snprintf(wk_last_code, sizeof wk_last_code, "%s", "DRIVER");
    if (wk_open_device(state, "nvidiactl", 1) < 0 || wk_open_device(state, "nvidia-uvm", 1) < 0) {
        snprintf(wk_last_code, sizeof wk_last_code, "%s", "NODEV");
        snprintf(err, errlen, "cannot open %s/nvidiactl or nvidia-uvm: %s", wk_dev_dir(state), strerror(errno));
        return -1;
    }
    /* Like the CUDA driver at start-up, open and map the device file of every
     * GPU, whichever one the memory is on (seen on an H200 pair: a process
     * using cuda:0 holds and maps /dev/nvidia0 and /dev/nvidia1). */
    for (int g = 0, n = wk_gpu_count(state); g < n; g++) {
        int m = wk_gpu_minor(state, (unsigned)g);
        snprintf(devname, sizeof devname, "nvidia%d", m < 0 ? g : m);
        wk_open_device(state, devname, 1);
    }
    sock = driver_connect(state, err, errlen);
    if (sock < 0) {
        snprintf(wk_last_code, sizeof wk_last_code, "%s", "NODAEMON");
        return -1;
    }
    snprintf(line, sizeof line, "register %u %llu %s\n", gpu, mib, kind ? kind : "compute");
    if (send_line(sock, line) < 0 || recv_line(sock, line, sizeof line) < 0) {
        snprintf(err, errlen, "driver daemon closed the connection");
        goto fail;
    }
    if (sscanf(line, "lock %u %u", &id, &minor) != 2) {
        driver_error(line, err, errlen);
        goto fail;
    }
    snprintf(devname, sizeof devname, "nvidia%u", minor);
    fd = wk_open_device(state, devname, 1);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s/%s: %s", wk_dev_dir(state), devname, strerror(errno));
        goto fail;
    }
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = id;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_SETLK, &fl) < 0) {
        snprintf(err, errlen, "cannot lock context %u on %s: %s", id, devname, strerror(errno));
        goto fail;
    }
    if (send_line(sock, "locked\n") < 0 || recv_line(sock, line, sizeof line) < 0) {
        snprintf(err, errlen, "driver daemon closed the connection");
        goto fail;
    }
    if (strncmp(line, "ok ", 3) != 0) {
        driver_error(line, err, errlen);
        goto fail;
    }
    close(sock);
    return (int)id;
fail:
    close(sock);
    return -1;
}

/* Open teardown/<id>[,<id>...] on the daemon's FUSE mount, once the contexts exist, and keep it:
 * when this process exits, closing it makes the kernel wait (state D) until the driver has freed
 * the contexts, as the NVIDIA driver's close does (gpusim/teardown.py). Without the mount this
 * is a no-op and the process exits at once. */
int wk_open_teardown(const char *state, const unsigned *ids, int n)
{
    char path[PATH_MAX];
    int len, fd;
    if (n <= 0)
        return -1;
    len = snprintf(path, sizeof path, "%s/teardown/", state);
    for (int i = 0; i < n && len < (int)sizeof path; i++)
        len += snprintf(path + len, sizeof path - (size_t)len, "%s%u", i ? "," : "", ids[i]);
    fd = open(path, O_RDWR | O_CLOEXEC);
    return fd;
}
