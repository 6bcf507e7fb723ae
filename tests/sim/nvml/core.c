/*
 * Library life cycle (init/shutdown), error strings, system queries and the
 * entry/exit helpers shared by every implemented entry point.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

pthread_mutex_t sim_mutex = PTHREAD_MUTEX_INITIALIZER;
unsigned sim_refcount;
sim_config_t sim_cfg;
char sim_state[PATH_MAX];
struct nvmlDevice_st sim_devices[SIM_MAX_GPUS];
unsigned long long sim_caller_pidns;
char sim_dev_dir[PATH_MAX];

/* Like the real library, an initialised NVML keeps the control devices open
 * (management clients show up as fd holders without mmaps). */
static int ctl_fd = -1;
static int uvm_fd = -1;

/* ------------------------------------------------------------------ errors */

typedef struct {
    nvmlReturn_t code;
    const char *name;
    const char *doc; /* the header's comment, used when no real string is known */
} sim_error_t;

/* Generated from nvml.h's nvmlReturn_t by gen_stubs.py, so every code is known. */
static const sim_error_t sim_errors[] = {
#include "nvml_errors.inc"
};

/* The strings the real libnvidia-ml returns (what pynvml's NVMLError prints). */
static const char *real_string(nvmlReturn_t rc)
{
    switch ((int)rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt request issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "The requested functionality has been deprecated";
    case NVML_ERROR_NOT_READY: return "System is not ready for the request";
    case NVML_ERROR_GPU_NOT_FOUND: return "No GPUs were found";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return NULL;
    }
}

const char *sim_error_string(nvmlReturn_t rc)
{
    const char *s = real_string(rc);
    if (s)
        return s;
    for (size_t i = 0; i < sizeof sim_errors / sizeof sim_errors[0]; i++)
        if (sim_errors[i].code == rc)
            return sim_errors[i].doc;
    return "Unknown Error";
}

/* "NVML_ERROR_TIMEOUT", "TIMEOUT", "timeout" or "10" -> NVML_ERROR_TIMEOUT.
 * An unknown name reads as NVML_ERROR_UNKNOWN (the fault still fires). */
nvmlReturn_t sim_error_from_name(const char *name)
{
    char *end;
    long v = strtol(name, &end, 0);
    if (end != name && *end == '\0')
        return (nvmlReturn_t)v;
    for (size_t i = 0; i < sizeof sim_errors / sizeof sim_errors[0]; i++) {
        const char *full = sim_errors[i].name;
        const char *shrt = strncmp(full, "NVML_ERROR_", 11) == 0 ? full + 11 : full + 5;
        if (strcasecmp(name, full) == 0 || strcasecmp(name, shrt) == 0)
            return sim_errors[i].code;
    }
    return NVML_ERROR_UNKNOWN;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    return sim_error_string(result);
}

/* ------------------------------------------------------- entry/exit helpers */

/* Does the timeout fault select function `fn`? A listed name without a
 * version suffix covers all its versions ("nvmlDeviceGetMemoryInfo" also
 * matches nvmlDeviceGetMemoryInfo_v2); "*" selects every implemented call. */
static int list_selects(const char *list, const char *fn)
{
    char key[160];
    size_t len;
    if (!list[0])
        return 0;
    if (strstr(list, ",*,"))
        return 1;
    snprintf(key, sizeof key, ",%s,", fn);
    if (strstr(list, key))
        return 1;
    len = strlen(fn);
    while (len > 0 && fn[len - 1] >= '0' && fn[len - 1] <= '9')
        len--;
    if (len >= 2 && len < strlen(fn) && fn[len - 1] == 'v' && fn[len - 2] == '_') {
        snprintf(key, sizeof key, ",%.*s,", (int)(len - 2), fn);
        return strstr(list, key) != NULL;
    }
    return 0;
}

static int timeout_selects(const char *fn)
{
    return list_selects(sim_cfg.timeout_functions, fn);
}

static int hang_selects(const char *fn)
{
    return list_selects(sim_cfg.hang_functions, fn);
}

/* A driver hang: the call never returns. A process stuck in the driver sits in an ioctl that waits
 * for the GPU; it still dies of SIGKILL (the kernel's wait is killable), and other threads of the
 * process, and other processes, can still make calls that do not touch the hung GPU. So: release
 * the library's lock, then wait forever. Signal handlers run (pause returns EINTR) and the wait goes
 * on; the fault being cleared later does not release it, as a real hang does not end by itself. */
static nvmlReturn_t hang_now(void)
{
    pthread_mutex_unlock(&sim_mutex);
    for (;;)
        pause();
    return NVML_ERROR_UNKNOWN; /* not reached */
}

/* Release the lock, wait out the configured hang, report the timeout. */
static nvmlReturn_t timeout_now(void)
{
    int ms = sim_cfg.timeout_delay_ms;
    pthread_mutex_unlock(&sim_mutex);
    if (ms > 0) {
        struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
            ;
    }
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t sim_enter(const char *fn)
{
    pthread_mutex_lock(&sim_mutex);
    if (!sim_refcount) {
        pthread_mutex_unlock(&sim_mutex);
        return NVML_ERROR_UNINITIALIZED;
    }
    sim_config_refresh();
    /* Handle lookups are per GPU: hand_out() applies the hang for the GPU asked for. */
    if (strncmp(fn, "nvmlDeviceGetHandleBy", 21) != 0 && hang_selects(fn))
        return hang_now();
    if (timeout_selects(fn))
        return timeout_now();
    return NVML_SUCCESS;
}

nvmlReturn_t sim_enter_dev(const char *fn, nvmlDevice_t device, const sim_gpu_t **gpu)
{
    const sim_gpu_t *g;
    pthread_mutex_lock(&sim_mutex);
    if (!sim_refcount) {
        pthread_mutex_unlock(&sim_mutex);
        return NVML_ERROR_UNINITIALIZED;
    }
    sim_config_refresh();
    /* A handle is valid only if it is exactly one of ours (never dereference a stranger). */
    uintptr_t off = (uintptr_t)device - (uintptr_t)sim_devices;
    if (!device || off >= sizeof sim_devices || off % sizeof sim_devices[0] != 0 ||
        device->index >= sim_cfg.gpu_count) {
        pthread_mutex_unlock(&sim_mutex);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    g = &sim_cfg.gpus[device->index];
    if (g->lost) {
        pthread_mutex_unlock(&sim_mutex);
        return NVML_ERROR_GPU_IS_LOST;
    }
    if (g->hang && hang_selects(fn))
        return hang_now();
    if (g->timeout && timeout_selects(fn))
        return timeout_now();
    *gpu = g;
    return NVML_SUCCESS;
}

nvmlReturn_t sim_leave(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&sim_mutex);
    return rc;
}

/* Is <dev dir>/<name> the driver's own node? 1: yes (the inode of its hard link in driver/, or no such link to tell),
 * 0: present but another file (a /dev/null or a regular file bound over it), -1: absent. The real driver serves only
 * its own numbers: with /dev/nvidia0 another device's, NVML does not list the GPU and cuInit finds no device; with
 * /dev/nvidiactl another device's, nvmlInit answers NVML_ERROR_OPERATING_SYSTEM (seen on an H100, driver 580.159.04:
 * docs/results/round4-facts-h100x1-2026-12-05.json). */
int sim_node_is_drivers(const char *name)
{
    char path[PATH_MAX + 64], own[PATH_MAX + 64];
    struct stat here, drivers;
    snprintf(path, sizeof path, "%s/%s", sim_dev_dir, name);
    if (stat(path, &here) != 0)
        return -1;
    snprintf(own, sizeof own, "%s/driver/%s", sim_state, name);
    if (stat(own, &drivers) != 0)
        return 1;
    return here.st_dev == drivers.st_dev && here.st_ino == drivers.st_ino;
}

/* The GPUs NVML lists, in its order: every GPU of node.conf but one whose device file is present and another
 * device's (an absent one is listed, as a container's NVML lists it). map[i] is NVML index i's GPU in node.conf. */
unsigned sim_visible(unsigned *map)
{
    char name[32];
    unsigned n = 0;
    for (unsigned i = 0; i < sim_cfg.gpu_count; i++) {
        snprintf(name, sizeof name, "nvidia%u", sim_cfg.gpus[i].minor);
        if (sim_node_is_drivers(name) == 0)
            continue;
        map[n++] = i;
    }
    return n;
}

/* Handing out a device handle opens the GPU's device file (kept until the
 * last nvmlShutdown), as libnvidia-ml does. Called with sim_mutex held. */
int sim_device_open(unsigned index)
{
    char path[PATH_MAX + 32];
    struct nvmlDevice_st *d = &sim_devices[index];
    if (d->fd < 0) {
        snprintf(path, sizeof path, "%s/nvidia%u", sim_dev_dir, sim_cfg.gpus[index].minor);
        d->fd = open(path, O_RDWR | O_CLOEXEC);
    }
    return d->fd;
}

nvmlReturn_t sim_copy_string(char *dst, unsigned length, const char *src)
{
    size_t n = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t sim_stub_result(void)
{
    nvmlReturn_t rc;
    pthread_mutex_lock(&sim_mutex);
    rc = sim_refcount ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_UNINITIALIZED;
    pthread_mutex_unlock(&sim_mutex);
    return rc;
}

/* ---------------------------------------------------------- init/shutdown */

static void close_all(void)
{
    if (ctl_fd >= 0)
        close(ctl_fd);
    if (uvm_fd >= 0)
        close(uvm_fd);
    ctl_fd = uvm_fd = -1;
    for (unsigned i = 0; i < SIM_MAX_GPUS; i++) {
        if (sim_devices[i].fd >= 0)
            close(sim_devices[i].fd);
        sim_devices[i].index = i;
        sim_devices[i].fd = -1;
    }
}

static nvmlReturn_t do_init(unsigned int flags)
{
    const char *state = getenv("GPUSIM_STATE");
    char path[PATH_MAX + 32];
    struct stat st;
    nvmlReturn_t rc;

    (void)flags; /* NO_GPUS / NO_ATTACH change nothing for a simulated node */
    pthread_mutex_lock(&sim_mutex);
    if (sim_refcount) {
        sim_refcount++;
        return sim_leave(NVML_SUCCESS);
    }
    /* No state directory or no description: as if nvidia.ko were not loaded. */
    if (!state || !state[0] || strlen(state) >= sizeof sim_state)
        return sim_leave(NVML_ERROR_DRIVER_NOT_LOADED);
    snprintf(sim_state, sizeof sim_state, "%s", state);
    /* Like the real library, which opens /dev/nvidia*: a node published under /dev says so. */
    if (getenv("GPUSIM_DEV_DIR") && getenv("GPUSIM_DEV_DIR")[0])
        snprintf(sim_dev_dir, sizeof sim_dev_dir, "%s", getenv("GPUSIM_DEV_DIR"));
    else
        snprintf(sim_dev_dir, sizeof sim_dev_dir, "%s/dev", state);
    sim_config_forget();
    if (sim_config_load(sim_state, &sim_cfg) < 0)
        return sim_leave(NVML_ERROR_DRIVER_NOT_LOADED);
    if (sim_cfg.init_error != NVML_SUCCESS)
        return sim_leave(sim_cfg.init_error);

    close_all();
    snprintf(path, sizeof path, "%s/nvidiactl", sim_dev_dir);
    ctl_fd = open(path, O_RDWR | O_CLOEXEC);
    /* As the real library: refused by the device cgroup or the file's mode, NO_PERMISSION; absent, DRIVER_NOT_LOADED;
     * another device's node, OPERATING_SYSTEM ("GPU access blocked by the operating system"). */
    if (ctl_fd < 0)
        return sim_leave(errno == EPERM || errno == EACCES ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_DRIVER_NOT_LOADED);
    if (sim_node_is_drivers("nvidiactl") == 0) {
        close_all();
        return sim_leave(NVML_ERROR_OPERATING_SYSTEM);
    }
    snprintf(path, sizeof path, "%s/nvidia-uvm", sim_dev_dir);
    uvm_fd = open(path, O_RDWR | O_CLOEXEC);

    /* The namespace cannot change for this process (setns only affects
     * children), so the caller's PID namespace is resolved once. */
    rc = stat("/proc/self/ns/pid", &st) == 0 ? NVML_SUCCESS : NVML_ERROR_OPERATING_SYSTEM;
    if (rc != NVML_SUCCESS) {
        close_all();
        return sim_leave(rc);
    }
    sim_caller_pidns = (unsigned long long)st.st_ino;
    sim_refcount = 1;
    return sim_leave(NVML_SUCCESS);
}

/* The real library ties its initialisation to the process: in a child forked after nvmlInit every
 * call answers NVML_ERROR_UNINITIALIZED until the child calls nvmlInit itself (seen on an H200,
 * driver 580.159.04: tools/gpu/nvml_raw.py --time). So a helper process must initialise NVML on its
 * own. The lock is taken around fork() so that the child never inherits it held. */
static void atfork_prepare(void)
{
    pthread_mutex_lock(&sim_mutex);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&sim_mutex);
}

static void atfork_child(void)
{
    sim_refcount = 0;
    pthread_mutex_unlock(&sim_mutex);
}

__attribute__((constructor)) static void register_atfork(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return do_init(0);
}

nvmlReturn_t nvmlInit(void)
{
    return do_init(0);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    return do_init(flags);
}

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&sim_mutex);
    if (!sim_refcount)
        return sim_leave(NVML_ERROR_UNINITIALIZED);
    if (--sim_refcount == 0)
        close_all();
    return sim_leave(NVML_SUCCESS);
}

/* ----------------------------------------------------------- system queries */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = sim_enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    return sim_leave(sim_copy_string(version, length, sim_cfg.driver_version));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = sim_enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    return sim_leave(sim_copy_string(version, length, sim_cfg.nvml_version));
}

static nvmlReturn_t cuda_version(const char *fn, int *cudaDriverVersion)
{
    nvmlReturn_t rc = sim_enter(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!cudaDriverVersion)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = sim_cfg.cuda_driver_version;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    return cuda_version(__func__, cudaDriverVersion);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return cuda_version(__func__, cudaDriverVersion);
}

/* Read at most size-1 bytes of a /proc file; returns the length or -1. */
static ssize_t read_small(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n;
    if (fd < 0)
        return -1;
    n = read(fd, buf, size - 1);
    close(fd);
    if (n < 0)
        return -1;
    buf[n] = '\0';
    return n;
}

/* The name NVML reports is argv[0] as the process shows it now (so a
 * setproctitle()'d worker reads "sglang::scheduler_TP0"), else its comm.
 * The pid is interpreted in the caller's /proc, i.e. its PID namespace. */
nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    char path[64], buf[4096];
    ssize_t n;
    size_t len;
    nvmlReturn_t rc = sim_enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!name || length == 0)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    snprintf(path, sizeof path, "/proc/%u/cmdline", pid);
    n = read_small(path, buf, sizeof buf);
    if (n <= 0 || buf[0] == '\0') {
        snprintf(path, sizeof path, "/proc/%u/comm", pid);
        n = read_small(path, buf, sizeof buf);
        if (n <= 0)
            return sim_leave(NVML_ERROR_NOT_FOUND);
        buf[strcspn(buf, "\n")] = '\0';
    }
    len = strlen(buf);
    if (len >= length)
        len = length - 1; /* "length: the maximum allowed length of the string returned" */
    memcpy(name, buf, len);
    name[len] = '\0';
    return sim_leave(NVML_SUCCESS);
}

__attribute__((constructor)) static void sim_lib_init(void)
{
    for (unsigned i = 0; i < SIM_MAX_GPUS; i++) {
        sim_devices[i].index = i;
        sim_devices[i].fd = -1;
    }
}
