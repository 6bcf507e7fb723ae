/*
 * The simulated libcuda.so.1: the CUDA driver API entry points a startability probe uses, on the node
 * the simulated NVML describes, through the same driver daemon and device files as gpusim-worker.
 *
 * What it shares with the rest of the node, so that NVML sees what the real driver shows:
 *
 *   - a primary context is a context of the daemon (register <gpu> 518 compute): the process holds and
 *     maps the device files, read-locks the context's byte, and NVML lists it with its memory, 527 MiB
 *     device-wide as on an H200 (518 charged + 9 of driver overhead);
 *   - cuMemAlloc grows that context (alloc <id> <mib>, refused with OUT_OF_MEMORY when it does not fit),
 *     cuMemFree shrinks it, cuDevicePrimaryCtxRelease frees it inside the call (release <id>, as the real
 *     release does: NVML reads the GPU idle as soon as it returns) and drops the lock;
 *   - a process killed with a context goes through the daemon's teardown like any worker.
 *
 * What makes it fail, each as the world does (docs/simulator.md, "The simulated libcuda"):
 *
 *   cuInit: no node (nvidia.ko not loaded) or no nvidiactl -> 100 NO_DEVICE; no openable nvidia-uvm
 *     (a container without it, the module not loaded) -> 999 UNKNOWN; a visible GPU whose NVLink fabric is
 *     not up (not started, in progress, or completed with an error) -> 802 SYSTEM_NOT_READY;
 *   context creation: the daemon's word -> OOM 2, BUSY 46 (exclusive_process with another process's
 *     context, or prohibited), ECC 214 (an uncontained ECC error not yet reset), NOTREADY 802, LOST and a
 *     missing daemon 999;
 *   any entry point named by the node's hang fault (fault.hang_functions, for a GPU of fault.hang_gpus)
 *     never returns: a UVM-wedged GPU.
 *
 * CUDA_VISIBLE_DEVICES is honoured (indexes, UUIDs, unique UUID prefixes; the list ends at the first
 * entry that matches nothing, an empty value hides every GPU), in NVML's order (PCI bus order). A
 * process forked after cuInit gets CUDA_ERROR_NOT_INITIALIZED (3) from every call, as CUDA is not
 * fork-safe. Steps take the times measured on an H200 (docs/results/cuda-facts-h200x1-2026-12-02.json):
 * node.conf's cuda_init_ms and cuda_ctx_ms here, cuda_release_ms in the daemon, which answers the release
 * once the context is freed.
 */
#define _GNU_SOURCE
#include "worker.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct {
    char bytes[16];
} CUuuid;

/* cuda.h's values (CUDA 13.0 header). */
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ECC_UNCORRECTABLE = 214,
    CUDA_ERROR_SYSTEM_NOT_READY = 802,
    CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_ALLOCS 256
#define CONTEXT_MIB 518ULL /* what NVML charges a bare primary context; + 9 MiB of overhead = 527 device-wide */
#define GRANULE_MIB 2ULL   /* allocations come in 2 MiB pages */

struct gpu {
    unsigned index; /* NVML index */
    unsigned minor;
    char uuid[96];
    char name[96];
    char bus_id[32];
    unsigned long long total_mib, reserved_mib;
};

struct CUctx_st {
    int device; /* ordinal */
    int refcount;
    int id; /* the daemon's context id */
    int teardown_fd;
};

static struct {
    int initialised;
    int forked; /* a child forked after cuInit: CUDA is not fork-safe */
    char state[PATH_MAX];
    int count;
    struct gpu gpus[MAX_GPUS]; /* the visible ones, in CUDA's order */
    struct CUctx_st ctx[MAX_GPUS];
    struct {
        CUdeviceptr ptr;
        unsigned long long mib;
        int device;
    } allocs[MAX_ALLOCS];
    CUdeviceptr next_ptr;
} cu;

static pthread_mutex_t cu_mutex = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current;

/* ------------------------------------------------------------------ node.conf */

/* The value of `key` in node.conf into out; 0 when found. */
static int conf(const char *key, char *out, size_t size)
{
    char path[PATH_MAX + 16], line[2304];
    size_t klen = strlen(key);
    int found = -1;
    FILE *f;
    snprintf(path, sizeof path, "%s/node.conf", cu.state);
    f = fopen(path, "re");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            snprintf(out, size, "%s", line + klen + 1);
            out[strcspn(out, "\n")] = '\0';
            found = 0;
            break;
        }
    }
    fclose(f);
    return found;
}

static long long conf_num(const char *key, long long dflt)
{
    char v[64];
    return conf(key, v, sizeof v) == 0 && v[0] ? strtoll(v, NULL, 0) : dflt;
}

static long long gpu_num(unsigned index, const char *field, long long dflt)
{
    char key[96];
    snprintf(key, sizeof key, "gpu.%u.%s", index, field);
    return conf_num(key, dflt);
}

/* Is `name` in the comma-separated list? "*" means every name. */
static int listed(const char *list, const char *name)
{
    char key[160], wrapped[2304];
    if (!list[0])
        return 0;
    snprintf(wrapped, sizeof wrapped, ",%s,", list);
    if (strstr(wrapped, ",*,"))
        return 1;
    snprintf(key, sizeof key, ",%s,", name);
    return strstr(wrapped, key) != NULL;
}

static void sleep_ms(long long ms)
{
    struct timespec ts;
    if (ms <= 0)
        return;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000L;
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

/* The node's hang fault: `fn` never returns when it names this entry point and, where it lists GPUs,
 * one of `gpus` (NVML indexes; -1 ends the list) is among them. The thread waits forever with the
 * library's lock released; SIGKILL ends the process, as for a call stuck in the real driver. */
static void maybe_hang(const char *fn, const int *gpus)
{
    char functions[2048], which[1024];
    if (conf("fault.hang_functions", functions, sizeof functions) != 0 || !listed(functions, fn))
        return;
    if (conf("fault.hang_gpus", which, sizeof which) == 0 && which[0]) {
        int hit = 0;
        for (int i = 0; gpus[i] >= 0 && !hit; i++) {
            char g[16];
            snprintf(g, sizeof g, "%d", gpus[i]);
            hit = listed(which, g);
        }
        if (!hit)
            return;
    }
    pthread_mutex_unlock(&cu_mutex);
    for (;;)
        pause();
}

static void maybe_hang_gpu(const char *fn, int device)
{
    int gpus[2] = {(int)cu.gpus[device].index, -1};
    maybe_hang(fn, gpus);
}

/* ------------------------------------------------------------------ errors */

static const struct {
    CUresult code;
    const char *name;
    const char *text; /* what the real cuGetErrorString says */
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ECC_UNCORRECTABLE, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {CUDA_ERROR_SYSTEM_NOT_READY, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            if (pStr)
                *pStr = errors[i].name;
            return CUDA_SUCCESS;
        }
    if (pStr)
        *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            if (pStr)
                *pStr = errors[i].text;
            return CUDA_SUCCESS;
        }
    if (pStr)
        *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* The daemon's word for a refusal, as the CUresult the real driver gives for that cause. */
static CUresult from_driver(const char *code)
{
    if (strcmp(code, "OOM") == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (strcmp(code, "BUSY") == 0)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    if (strcmp(code, "ECC") == 0)
        return CUDA_ERROR_ECC_UNCORRECTABLE;
    if (strcmp(code, "NOTREADY") == 0)
        return CUDA_ERROR_SYSTEM_NOT_READY;
    if (strcmp(code, "BADGPU") == 0)
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_ERROR_UNKNOWN; /* LOST, NODEV, NODAEMON, a broken protocol */
}

/* ------------------------------------------------------------------ enumeration */

static int can_open(const char *name)
{
    char path[PATH_MAX + 64];
    int fd;
    struct stat here, drivers;
    char own[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", wk_dev_dir(cu.state), name);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return 0;
    /* Only the driver's own node serves CUDA (its hard link in driver/ is the same inode): another device's node
     * bound over it opens, and the driver refuses it (cuInit 999 for nvidia-uvm, no device for a GPU or nvidiactl,
     * as on an H100: docs/results/round4-facts-h100x1-2026-12-05.json). */
    snprintf(own, sizeof own, "%s/driver/%s", cu.state, name);
    if (fstat(fd, &here) == 0 && stat(own, &drivers) == 0 && (here.st_dev != drivers.st_dev || here.st_ino != drivers.st_ino)) {
        close(fd);
        return 0;
    }
    close(fd);
    return 1;
}

static void read_gpu(unsigned index, struct gpu *g)
{
    char key[64];
    memset(g, 0, sizeof *g);
    g->index = index;
    g->minor = (unsigned)gpu_num(index, "minor", index);
    snprintf(key, sizeof key, "gpu.%u.uuid", index);
    conf(key, g->uuid, sizeof g->uuid);
    snprintf(key, sizeof key, "gpu.%u.name", index);
    conf(key, g->name, sizeof g->name);
    snprintf(key, sizeof key, "gpu.%u.pci_bus_id", index);
    conf(key, g->bus_id, sizeof g->bus_id);
    g->total_mib = (unsigned long long)gpu_num(index, "total_mib", 0);
    g->reserved_mib = (unsigned long long)gpu_num(index, "reserved_mib", 0);
}

/* Which NVML index a CUDA_VISIBLE_DEVICES entry names: a number, a UUID or a unique UUID prefix
 * (with or without "GPU-"); -1 when none. */
static int match_entry(const char *entry, const struct gpu *all, int n)
{
    char *end;
    long v = strtol(entry, &end, 10);
    int found = -1;
    if (end != entry && *end == '\0')
        return v >= 0 && v < n ? (int)v : -1;
    const char *want = strncasecmp(entry, "GPU-", 4) == 0 ? entry + 4 : entry;
    if (!want[0])
        return -1;
    for (int i = 0; i < n; i++) {
        const char *have = strncasecmp(all[i].uuid, "GPU-", 4) == 0 ? all[i].uuid + 4 : all[i].uuid;
        if (strncasecmp(have, want, strlen(want)) == 0) {
            if (found >= 0)
                return -1; /* ambiguous prefix */
            found = i;
        }
    }
    return found;
}

static int visible(struct gpu *out)
{
    static struct gpu all[MAX_GPUS];
    int n = (int)conf_num("gpu_count", 0), count = 0;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (n > MAX_GPUS)
        n = MAX_GPUS;
    for (int i = 0; i < n; i++)
        read_gpu((unsigned)i, &all[i]);
    if (!cvd) {
        for (int i = 0; i < n; i++)
            out[count++] = all[i];
        return count;
    }
    char list[1024], *save = NULL;
    snprintf(list, sizeof list, "%s", cvd);
    for (char *entry = strtok_r(list, ",", &save); entry && count < MAX_GPUS; entry = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*entry))
            entry++;
        int i = match_entry(entry, all, n);
        if (i < 0)
            break; /* CUDA stops at the first entry that names no GPU */
        out[count++] = all[i];
    }
    return count;
}

/* ------------------------------------------------------------------ entry points */

static void atfork_child(void)
{
    if (cu.initialised)
        cu.forked = 1;
    current = NULL;
    pthread_mutex_init(&cu_mutex, NULL);
}

__attribute__((constructor)) static void cu_register_atfork(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
}

/* Every entry point but cuInit: initialised, not in a forked child. */
static CUresult ready(void)
{
    if (cu.forked || !cu.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

static CUresult leave(CUresult rc)
{
    pthread_mutex_unlock(&cu_mutex);
    return rc;
}

CUresult cuInit(unsigned int Flags)
{
    const char *state = getenv("GPUSIM_STATE");
    struct gpu found[MAX_GPUS];
    int n, gpus[MAX_GPUS + 1], usable = 0;

    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    if (cu.forked)
        return leave(CUDA_ERROR_NOT_INITIALIZED);
    if (cu.initialised)
        return leave(CUDA_SUCCESS);
    if (!state || !state[0] || strlen(state) >= sizeof cu.state)
        return leave(CUDA_ERROR_NO_DEVICE); /* no node: as if nvidia.ko were not loaded */
    snprintf(cu.state, sizeof cu.state, "%s", state);
    n = visible(found);
    for (int i = 0; i < n; i++)
        gpus[i] = (int)found[i].index;
    gpus[n] = -1;
    sleep_ms(conf_num("cuda_init_ms", 0));
    maybe_hang("cuInit", gpus);
    if (conf_num("gpu_count", -1) < 0 || !can_open("nvidiactl"))
        return leave(CUDA_ERROR_NO_DEVICE);
    /* The unified-memory device is needed by every CUDA start (NVML does not need it). */
    if (!can_open("nvidia-uvm"))
        return leave(CUDA_ERROR_UNKNOWN);
    for (int i = 0; i < n; i++) {
        char name[32], features[128], key[64];
        long long fabric_state = gpu_num(found[i].index, "fabric_state", 3), fabric_status = gpu_num(found[i].index, "fabric_status", 0);
        snprintf(key, sizeof key, "gpu.%u.features", found[i].index);
        if (conf(key, features, sizeof features) == 0 && strstr(features, "fabric") && (fabric_state == 1 || fabric_state == 2 || fabric_status != 0))
            return leave(CUDA_ERROR_SYSTEM_NOT_READY); /* Fabric Manager has not brought the NVLink fabric up */
        if (gpu_num(found[i].index, "lost", 0))
            continue;
        snprintf(name, sizeof name, "nvidia%u", found[i].minor);
        if (!can_open(name))
            continue; /* a GPU whose device file is not here is not a device CUDA can use */
        cu.gpus[usable++] = found[i];
    }
    cu.count = usable;
    if (usable == 0)
        return leave(CUDA_ERROR_NO_DEVICE);
    cu.next_ptr = 0x7f0000000000ULL;
    cu.initialised = 1;
    return leave(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    /* Answers before cuInit too, from the library itself. */
    *driverVersion = 13000;
    if (getenv("GPUSIM_STATE")) {
        pthread_mutex_lock(&cu_mutex);
        if (!cu.state[0])
            snprintf(cu.state, sizeof cu.state, "%s", getenv("GPUSIM_STATE"));
        *driverVersion = (int)conf_num("cuda_driver_version", 13000);
        pthread_mutex_unlock(&cu_mutex);
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = cu.count;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= cu.count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static CUresult check_device(CUdevice dev)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    return dev < 0 || dev >= cu.count ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", cu.gpus[dev].name);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = check_device(dev);
    const char *p;
    int i = 0;
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    memset(uuid, 0, sizeof *uuid);
    p = cu.gpus[dev].uuid;
    if (strncasecmp(p, "GPU-", 4) == 0)
        p += 4;
    while (*p && i < 16) {
        unsigned byte;
        if (*p == '-') {
            p++;
            continue;
        }
        if (sscanf(p, "%2x", &byte) != 1)
            break;
        uuid->bytes[i++] = (char)byte;
        p += 2;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid_v2(uuid, dev);
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    CUresult rc = check_device(dev);
    unsigned d = 0, b = 0, s = 0, f = 0;
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    sscanf(cu.gpus[dev].bus_id, "%x:%x:%x.%x", &d, &b, &s, &f);
    snprintf(pciBusId, (size_t)len, "%04x:%02x:%02x.%x", d, b, s, f); /* CUDA's form: 0000:18:00.0 */
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)((cu.gpus[dev].total_mib - cu.gpus[dev].reserved_mib) << 20);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    CUresult rc = check_device(dev);
    unsigned d = 0, b = 0, s = 0;
    char path[PATH_MAX + 32], buf[16];
    FILE *f;
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    sscanf(cu.gpus[dev].bus_id, "%x:%x:%x", &d, &b, &s);
    switch (attrib) {
    case 20: /* CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: the file the simulated NVML writes */
        *pi = 0;
        snprintf(path, sizeof path, "%s/compute_mode.%u", cu.state, cu.gpus[dev].index);
        if ((f = fopen(path, "re")) != NULL) {
            if (fgets(buf, sizeof buf, f))
                *pi = atoi(buf);
            fclose(f);
        }
        return CUDA_SUCCESS;
    case 33: /* PCI_BUS_ID */
        *pi = (int)b;
        return CUDA_SUCCESS;
    case 34: /* PCI_DEVICE_ID */
        *pi = (int)s;
        return CUDA_SUCCESS;
    case 50: /* PCI_DOMAIN_ID */
        *pi = (int)d;
        return CUDA_SUCCESS;
    case 75: /* COMPUTE_CAPABILITY_MAJOR: Hopper */
        *pi = 9;
        return CUDA_SUCCESS;
    case 76:
        *pi = 0;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE; /* not simulated */
    }
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    char err[512];
    struct CUctx_st *c;
    unsigned id;
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    c = &cu.ctx[dev];
    if (c->refcount > 0) {
        c->refcount++;
        *pctx = c;
        return leave(CUDA_SUCCESS);
    }
    sleep_ms(conf_num("cuda_ctx_ms", 0));
    maybe_hang_gpu("cuDevicePrimaryCtxRetain", dev);
    int got = wk_create_context(cu.state, cu.gpus[dev].index, CONTEXT_MIB, "compute", err, sizeof err);
    if (got < 0)
        return leave(from_driver(wk_last_code));
    id = (unsigned)got;
    c->device = dev;
    c->id = got;
    c->refcount = 1;
    /* Kept open until the release: a process killed with the context waits in the driver's teardown. */
    c->teardown_fd = wk_open_teardown(cu.state, &id, 1);
    *pctx = c;
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (ctx && (ctx < cu.ctx || ctx >= cu.ctx + MAX_GPUS || ctx->refcount <= 0))
        return CUDA_ERROR_INVALID_CONTEXT;
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current;
    return CUDA_SUCCESS;
}

static CUresult need_context(void)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    return current && current->refcount > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    char request[64], reply[128], err[256];
    unsigned long long free_mib = 0, total_mib = 0;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    snprintf(request, sizeof request, "meminfo %u", cu.gpus[current->device].index);
    if (wk_request(cu.state, request, reply, sizeof reply, err, sizeof err) < 0 || sscanf(reply, "ok %llu %llu", &free_mib, &total_mib) != 2)
        return leave(CUDA_ERROR_UNKNOWN);
    *free = (size_t)(free_mib << 20);
    *total = (size_t)(total_mib << 20);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    char request[64], reply[128], err[256];
    unsigned long long mib;
    int slot = -1;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    mib = (((unsigned long long)bytesize + (GRANULE_MIB << 20) - 1) >> 20) / GRANULE_MIB * GRANULE_MIB;
    pthread_mutex_lock(&cu_mutex);
    maybe_hang_gpu("cuMemAlloc_v2", current->device);
    for (int i = 0; i < MAX_ALLOCS && slot < 0; i++)
        if (!cu.allocs[i].ptr)
            slot = i;
    if (slot < 0)
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    snprintf(request, sizeof request, "alloc %d %llu", current->id, mib);
    if (wk_request(cu.state, request, reply, sizeof reply, err, sizeof err) < 0)
        return leave(from_driver(wk_last_code));
    cu.allocs[slot].ptr = cu.next_ptr;
    cu.allocs[slot].mib = mib;
    cu.allocs[slot].device = current->device;
    cu.next_ptr += mib << 20;
    *dptr = cu.allocs[slot].ptr;
    return leave(CUDA_SUCCESS);
}

static int find_alloc(CUdeviceptr ptr)
{
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (cu.allocs[i].ptr && ptr >= cu.allocs[i].ptr && ptr < cu.allocs[i].ptr + (cu.allocs[i].mib << 20))
            return i;
    return -1;
}

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    int i;
    CUresult rc = need_context();
    (void)uc;
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    i = find_alloc(dstDevice);
    if (i < 0 || dstDevice + N > cu.allocs[i].ptr + (cu.allocs[i].mib << 20))
        return leave(CUDA_ERROR_INVALID_VALUE);
    maybe_hang_gpu("cuMemsetD8_v2", current->device);
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void)
{
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    maybe_hang_gpu("cuCtxSynchronize", current->device);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    char request[64], reply[128], err[256];
    int i;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    i = find_alloc(dptr);
    if (i < 0 || cu.allocs[i].ptr != dptr)
        return leave(CUDA_ERROR_INVALID_VALUE);
    snprintf(request, sizeof request, "free %d %llu", cu.ctx[cu.allocs[i].device].id, cu.allocs[i].mib);
    wk_request(cu.state, request, reply, sizeof reply, err, sizeof err);
    cu.allocs[i].ptr = 0;
    return leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    char request[64], reply[128], err[256], devname[32];
    struct CUctx_st *c;
    struct flock fl;
    int fd;
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    c = &cu.ctx[dev];
    if (c->refcount <= 0)
        return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (--c->refcount > 0)
        return leave(CUDA_SUCCESS);
    maybe_hang_gpu("cuDevicePrimaryCtxRelease", dev);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (cu.allocs[i].ptr && cu.allocs[i].device == dev)
            cu.allocs[i].ptr = 0; /* the release frees what is left with the context */
    /* The driver tears the context down inside the call; NVML reads it gone when the call returns. */
    snprintf(request, sizeof request, "release %d", c->id);
    if (wk_request(cu.state, request, reply, sizeof reply, err, sizeof err) == 0) {
        long long wait_ms = 0;
        if (sscanf(reply, "ok %lld", &wait_ms) == 1)
            sleep_ms(wait_ms); /* the daemon's teardown of the context, which the call waits for */
    }
    snprintf(devname, sizeof devname, "nvidia%u", cu.gpus[dev].minor);
    fd = wk_open_device(cu.state, devname, 0);
    if (fd >= 0) {
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_UNLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = c->id;
        fl.l_len = 1;
        fcntl(fd, F_OFD_SETLK, &fl);
    }
    if (c->teardown_fd >= 0)
        close(c->teardown_fd);
    c->teardown_fd = -1;
    if (current == c)
        current = NULL;
    return leave(CUDA_SUCCESS);
}

/* The unversioned symbol the legacy ABI keeps (cuda.h maps the name to _v2). */
CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}
