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
 * Peers (issue 39): cuDeviceCanAccessPeer, cuCtxEnablePeerAccess / cuCtxDisablePeerAccess (217 PEER_ACCESS_UNSUPPORTED,
 * 704 ALREADY_ENABLED, 705 NOT_ENABLED), cuMemcpyPeer(Async), cuMemcpyHtoD / DtoH and events. An allocation of up to
 * 1 GiB is backed by host memory, so that a copy really moves its bytes and a test reads back what it wrote; a bigger
 * one (the start's 90 %) is bookkeeping only. A copy between two GPUs takes the time its bytes need at the pair's
 * bandwidth: over NVLink (both GPUs' active links to the NVSwitch fabric, 25 GB/s each for NVLink 4) or PCIe (the
 * narrower link of the two, at the generation it trained at) when peer access is enabled, at 80 % of the link's
 * nominal rate as measured copies reach; staged through host memory (40 % of the PCIe rate) when it is not. The node
 * can say otherwise per pair: p2p.unsupported (no peer access: CanAccessPeer 0, Enable 217), p2p.corrupt (the
 * copy's bytes arrive changed), p2p.hang (the copy never completes: SIGKILL ends the process), p2p.gbps (the rate).
 *
 * CUDA_VISIBLE_DEVICES is honoured (indexes, UUIDs, unique UUID prefixes; the list ends at the first
 * entry that matches nothing, an empty value hides every GPU), in NVML's order (PCI bus order). A
 * process forked after cuInit gets CUDA_ERROR_NOT_INITIALIZED (3) from every call, as CUDA is not
 * fork-safe. Steps take the times measured on an H200 (docs/results/cuda-facts-h200x1-2026-12-02.json):
 * node.conf's cuda_init_ms and cuda_ctx_ms here, cuda_release_ms in the daemon, which answers the release
 * once the context is freed; a memset's bytes at cuda_memset_gbps, which the next synchronize waits for, and a
 * free at cuda_free_us_per_gib (docs/results/startable-h200x1-2026-12-02.json).
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
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
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
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_SYSTEM_NOT_READY = 802,
    CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_ALLOCS 256
#define CONTEXT_MIB 518ULL /* what NVML charges a bare primary context; + 9 MiB of overhead = 527 device-wide */
#define GRANULE_MIB 2ULL   /* allocations come in 2 MiB pages */
#define BACKED_MAX_MIB 1024ULL /* allocations up to this size hold their bytes in host memory */
#define MAX_EVENTS 256

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
    long long pending_ns; /* work queued on its stream (a memset), which the next synchronize waits for */
};

struct CUevent_st {
    int used;
    int device;    /* the context it belongs to */
    int timing;    /* not created with CU_EVENT_DISABLE_TIMING */
    long long ns;  /* when it was recorded (every operation here completes before the call returns); 0: never */
};

/* The last peer copy made into an allocation: the same copy again over unchanged bytes need not move them. */
struct copy_mark {
    int src, direct;
    CUdeviceptr sptr, dptr;
    size_t n;
    unsigned long long src_version, version;
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
        unsigned char *bytes; /* host memory standing for it (allocations up to BACKED_MAX_MIB), else NULL */
        /* Its bytes change with each write (version); the last peer copy into it, so that the same copy made again
         * over unchanged bytes (a timed run of copies) costs the host nothing, as it costs a real GPU's host nothing. */
        unsigned long long version;
        struct copy_mark last;
    } allocs[MAX_ALLOCS];
    CUdeviceptr next_ptr;
    unsigned char peer[MAX_GPUS][MAX_GPUS]; /* peer[a][b]: a's context may access b's memory */
    /* The copy engines' clock: the time the copies made so far take at their pairs' rates. Events read it, so that
     * the time between two of them is the device's work between them; the host's time to issue that work (a few
     * microseconds a call on a real GPU, and the simulation's own memmove) is not in it. */
    long long device_ns;
    struct CUevent_st events[MAX_EVENTS];
} cu;

static pthread_mutex_t cu_mutex = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current;

/* ------------------------------------------------------------------ node.conf */

/* node.conf as last read: read again only when it was replaced (gpusim renames a new file in), so that a lookup
 * costs a stat and a search of memory, as the NVML library's refresh does (a peer copy looks up a dozen keys). */
static struct {
    pthread_mutex_t lock;
    char *text;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} node_conf = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, {0, 0}};

/* The value of `key` in node.conf into out; 0 when found. */
static int conf(const char *key, char *out, size_t size)
{
    char path[PATH_MAX + 16];
    size_t klen = strlen(key);
    struct stat st;
    int found = -1;
    snprintf(path, sizeof path, "%s/node.conf", cu.state);
    pthread_mutex_lock(&node_conf.lock);
    if (stat(path, &st) == 0 && (!node_conf.text || st.st_ino != node_conf.ino || st.st_size != node_conf.size ||
                                 st.st_mtim.tv_sec != node_conf.mtime.tv_sec || st.st_mtim.tv_nsec != node_conf.mtime.tv_nsec)) {
        FILE *f = fopen(path, "re");
        char *text = f ? calloc(1, (size_t)st.st_size + 2) : NULL;
        if (text && fread(text, 1, (size_t)st.st_size, f) == (size_t)st.st_size) {
            text[st.st_size] = '\n';
            free(node_conf.text);
            node_conf.text = text;
            node_conf.ino = st.st_ino;
            node_conf.size = st.st_size;
            node_conf.mtime = st.st_mtim;
        } else {
            free(text);
        }
        if (f)
            fclose(f);
    }
    for (const char *line = node_conf.text; line && *line;) {
        const char *end = strchr(line, '\n');
        if (!end)
            break;
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            size_t n = (size_t)(end - (line + klen + 1));
            if (n >= size)
                n = size - 1;
            memcpy(out, line + klen + 1, n);
            out[n] = '\0';
            found = 0;
            break;
        }
        line = end + 1;
    }
    pthread_mutex_unlock(&node_conf.lock);
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
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
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
    /* The time a context takes to make is spent outside the library's lock: a process making contexts on several
     * GPUs from several threads makes them side by side (an assumption until measured on two or more real GPUs:
     * tools/gpu/peers.py times it). */
    {
        long long ms = conf_num("cuda_ctx_ms", 0);
        pthread_mutex_unlock(&cu_mutex);
        sleep_ms(ms);
        pthread_mutex_lock(&cu_mutex);
    }
    if (c->refcount > 0) { /* another thread made it meanwhile */
        c->refcount++;
        *pctx = c;
        return leave(CUDA_SUCCESS);
    }
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
    cu.allocs[slot].bytes = NULL;
    cu.allocs[slot].version = 0;
    cu.allocs[slot].last.src = -1;
    if (mib <= BACKED_MAX_MIB) {
        void *m = mmap(NULL, (size_t)(mib << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        cu.allocs[slot].bytes = m == MAP_FAILED ? NULL : m;
    }
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

static void drop_alloc(int i)
{
    if (cu.allocs[i].bytes)
        munmap(cu.allocs[i].bytes, (size_t)(cu.allocs[i].mib << 20));
    cu.allocs[i].bytes = NULL;
    cu.allocs[i].ptr = 0;
}

/* The host memory standing for [ptr, ptr + n) of one allocation: NULL when it is not one allocation's (the caller
 * says INVALID_VALUE), *unbacked set when the allocation keeps no bytes (a large one: bookkeeping only). */
static unsigned char *bytes_of(CUdeviceptr ptr, size_t n, int *device, int *unbacked)
{
    int i = find_alloc(ptr);
    *unbacked = 0;
    if (i < 0 || ptr + n > cu.allocs[i].ptr + (cu.allocs[i].mib << 20))
        return NULL;
    if (device)
        *device = cu.allocs[i].device;
    if (!cu.allocs[i].bytes) {
        *unbacked = 1;
        return (unsigned char *)1; /* not dereferenced */
    }
    return cu.allocs[i].bytes + (ptr - cu.allocs[i].ptr);
}

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    int i;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    i = find_alloc(dstDevice);
    if (i < 0 || dstDevice + N > cu.allocs[i].ptr + (cu.allocs[i].mib << 20))
        return leave(CUDA_ERROR_INVALID_VALUE);
    maybe_hang_gpu("cuMemsetD8_v2", current->device);
    if (cu.allocs[i].bytes)
        memset(cu.allocs[i].bytes + (dstDevice - cu.allocs[i].ptr), uc, N);
    cu.allocs[i].version++;
    /* Asynchronous, as the real one: the GPU sets the bytes at its memory's rate, the next synchronize waits for it
     * (the H200: 128840 MiB set and synchronized in 0.031 s, docs/results/startable-h200x1-2026-12-02.json). */
    current->pending_ns += (long long)((double)N / ((double)conf_num("cuda_memset_gbps", 4400) * 1e9) * 1e9);
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void)
{
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    long long wait;
    pthread_mutex_lock(&cu_mutex);
    maybe_hang_gpu("cuCtxSynchronize", current->device);
    wait = current->pending_ns;
    current->pending_ns = 0;
    pthread_mutex_unlock(&cu_mutex);
    if (wait > 0) {
        struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
            ;
    }
    return CUDA_SUCCESS;
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
    /* A free takes time with its size (the H200: 0.05-0.08 s for 126 GiB, 0.003 s for 4 GiB): the driver unmaps it. */
    long long us = (long long)(cu.allocs[i].mib * (unsigned long long)conf_num("cuda_free_us_per_gib", 600) / 1024);
    drop_alloc(i);
    pthread_mutex_unlock(&cu_mutex);
    sleep_ms(us / 1000);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    char request[64], reply[128], err[256], devname[32];
    struct CUctx_st *c;
    struct flock fl;
    int fd, id, teardown_fd;
    long long wait_ms = 0;
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
            drop_alloc(i); /* the release frees what is left with the context */
    for (int i = 0; i < MAX_GPUS; i++)
        cu.peer[dev][i] = cu.peer[i][dev] = 0; /* and the peer access from it and to it */
    /* The driver tears the context down inside the call; NVML reads it gone when the call returns. */
    snprintf(request, sizeof request, "release %d", c->id);
    if (wk_request(cu.state, request, reply, sizeof reply, err, sizeof err) == 0 && sscanf(reply, "ok %lld", &wait_ms) != 1)
        wait_ms = 0;
    id = c->id;
    teardown_fd = c->teardown_fd;
    c->teardown_fd = -1;
    if (current == c)
        current = NULL;
    snprintf(devname, sizeof devname, "nvidia%u", cu.gpus[dev].minor);
    pthread_mutex_unlock(&cu_mutex);
    /* The daemon's teardown of the context, which the call waits for: outside the lock, so that a process releasing
     * its contexts on several GPUs from several threads releases them side by side. */
    sleep_ms(wait_ms);
    fd = wk_open_device(cu.state, devname, 0);
    if (fd >= 0) {
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_UNLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = id;
        fl.l_len = 1;
        fcntl(fd, F_OFD_SETLK, &fl);
    }
    if (teardown_fd >= 0)
        close(teardown_fd);
    return CUDA_SUCCESS;
}

/* The unversioned symbol the legacy ABI keeps (cuda.h maps the name to _v2). */
CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

/* ------------------------------------------------------------------ peers (issue 39) */

static long long now_ns(void);

static int gpu_index(int device)
{
    return (int)cu.gpus[device].index;
}

/* Is the pair (NVML indexes) named in node.conf's list `key` ("a-b,c-d", either order)? */
static int pair_in(const char *key, int a, int b)
{
    char list[2048], *save = NULL;
    if (conf(key, list, sizeof list) != 0 || !list[0])
        return 0;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int x, y;
        if (sscanf(tok, "%d-%d", &x, &y) == 2 && ((x == a && y == b) || (x == b && y == a)))
            return 1;
    }
    return 0;
}

/* node.conf's "a-b:gbps" for the pair, else 0. */
static double pair_gbps(int a, int b)
{
    char list[2048], *save = NULL;
    if (conf("p2p.gbps", list, sizeof list) != 0 || !list[0])
        return 0;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int x, y;
        double g;
        if (sscanf(tok, "%d-%d:%lf", &x, &y, &g) == 3 && ((x == a && y == b) || (x == b && y == a)))
            return g;
    }
    return 0;
}

static int active_nvlinks(int index)
{
    char key[64], down[256];
    long long n = gpu_num((unsigned)index, "nvlinks", 0);
    int active = 0;
    snprintf(key, sizeof key, "gpu.%d.nvlink_down", index);
    if (conf(key, down, sizeof down) != 0)
        down[0] = '\0';
    for (long long l = 0; l < n; l++) {
        char want[32], wrapped[300];
        snprintf(want, sizeof want, ",%lld,", l);
        snprintf(wrapped, sizeof wrapped, ",%s,", down);
        if (!strstr(wrapped, want))
            active++;
    }
    return gpu_num((unsigned)index, "nvlink_remote", 2) == 2 ? active : 0; /* links to the NVSwitch fabric */
}

/* GB/s per lane of each PCIe generation, after encoding (1: 2.5 GT/s 8b/10b ... 5: 32 GT/s 128b/130b). */
static double lane_gbps(long long gen)
{
    static const double rate[] = {0, 0.25, 0.5, 0.985, 1.969, 3.938, 7.877};
    return gen >= 1 && gen <= 6 ? rate[gen] : 0.25;
}

static double pcie_gbps(int index)
{
    return lane_gbps(gpu_num((unsigned)index, "pcie_gen", 5)) * (double)gpu_num((unsigned)index, "pcie_width", 16);
}

/* What a copy between the two GPUs moves per second, and whether it goes over the peer path. */
static double copy_rate(int a, int b, int *direct)
{
    double over = pair_gbps(a, b), pcie = pcie_gbps(a) < pcie_gbps(b) ? pcie_gbps(a) : pcie_gbps(b);
    int la = active_nvlinks(a), lb = active_nvlinks(b);
    *direct = 0;
    if (a == b)
        return 1000.0; /* on one GPU: its memory's bandwidth, roughly */
    if (!pair_in("p2p.unsupported", a, b)) {
        int da = -1, db = -1;
        for (int d = 0; d < cu.count; d++) {
            if (gpu_index(d) == a)
                da = d;
            if (gpu_index(d) == b)
                db = d;
        }
        *direct = da >= 0 && db >= 0 && (cu.peer[da][db] || cu.peer[db][da]);
    }
    if (over > 0)
        return over;
    if (!*direct)
        return 0.4 * pcie; /* staged through host memory: two PCIe hops */
    if (la && lb) {
        long long v = gpu_num((unsigned)a, "nvlink_version", 6);
        double per_link = v >= 7 ? 50.0 : 25.0; /* NVLink 5: 50 GB/s a link and direction, 2 to 4: 25 */
        return 0.8 * per_link * (la < lb ? la : lb);
    }
    return 0.8 * pcie;
}

CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = check_device(peerDev)) != CUDA_SUCCESS)
        return rc;
    if (!canAccessPeer)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    *canAccessPeer = dev != peerDev && !pair_in("p2p.unsupported", gpu_index(dev), gpu_index(peerDev));
    return leave(CUDA_SUCCESS);
}

static int valid_ctx(CUcontext ctx)
{
    return ctx && ctx >= cu.ctx && ctx < cu.ctx + MAX_GPUS && ctx->refcount > 0;
}

CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_ctx(current) || !valid_ctx(peerContext))
        return leave(CUDA_ERROR_INVALID_CONTEXT);
    /* A GPU is not its own peer: cuDeviceCanAccessPeer says 0 and enabling says 217, as an H100 answered
     * (docs/results/round4-facts-h100x1-2026-12-05.json, peer_one_gpu). */
    if (peerContext == current || pair_in("p2p.unsupported", gpu_index(current->device), gpu_index(peerContext->device)))
        return leave(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    if (cu.peer[current->device][peerContext->device])
        return leave(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    cu.peer[current->device][peerContext->device] = 1;
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxDisablePeerAccess(CUcontext peerContext)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_ctx(current) || !valid_ctx(peerContext))
        return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (!cu.peer[current->device][peerContext->device])
        return leave(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    cu.peer[current->device][peerContext->device] = 0;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    unsigned char *dst;
    int unbacked;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!srcHost && ByteCount)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    if (!(dst = bytes_of(dstDevice, ByteCount, NULL, &unbacked)))
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (!unbacked)
        memcpy(dst, srcHost, ByteCount);
    cu.allocs[find_alloc(dstDevice)].version++;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    unsigned char *src;
    int unbacked;
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dstHost && ByteCount)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    if (!(src = bytes_of(srcDevice, ByteCount, NULL, &unbacked)))
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (!unbacked)
        memcpy(dstHost, src, ByteCount);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount)
{
    unsigned char *dst, *src;
    int dst_dev = -1, src_dev = -1, ub_dst, ub_src, direct, a, b;
    double gbps;
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_ctx(dstContext) || !valid_ctx(srcContext))
        return leave(CUDA_ERROR_INVALID_CONTEXT);
    dst = bytes_of(dstDevice, ByteCount, &dst_dev, &ub_dst);
    src = bytes_of(srcDevice, ByteCount, &src_dev, &ub_src);
    if (!dst || !src || dst_dev != dstContext->device || src_dev != srcContext->device)
        return leave(CUDA_ERROR_INVALID_VALUE);
    a = gpu_index(src_dev);
    b = gpu_index(dst_dev);
    gbps = copy_rate(a, b, &direct);
    if (a != b && pair_in("p2p.hang", a, b)) {
        /* A broken peer path: the copy never completes, the thread waits in the driver until SIGKILL. */
        pthread_mutex_unlock(&cu_mutex);
        for (;;)
            pause();
    }
    {
        /* The copy engine's time is the bytes at the pair's rate (d): the device clock advances by d, and the call
         * takes d of wall time where d is long enough to matter (a real copy is asynchronous, its caller waits for it
         * in cuEventSynchronize or the next blocking call). */
        long long began = now_ns(), d_ns = gbps > 0 ? (long long)((double)ByteCount / (gbps * 1e9) * 1e9) : 0, spent;
        int si = find_alloc(srcDevice), di = find_alloc(dstDevice);
        struct copy_mark *last = &cu.allocs[di].last;
        int again = last->src == si && last->direct == direct && last->sptr == srcDevice && last->dptr == dstDevice && last->n == ByteCount &&
                    last->src_version == cu.allocs[si].version && last->version == cu.allocs[di].version && si != di;
        if (!ub_dst && !ub_src && !again) {
            memmove(dst, src, ByteCount);
            if (direct && pair_in("p2p.corrupt", a, b))
                for (size_t i = 0; i < ByteCount; i += 4096)
                    dst[i] ^= 0x5a; /* what crosses the broken peer path arrives changed */
        }
        if (!again) {
            cu.allocs[di].version++;
            last->src = si;
            last->direct = direct;
            last->sptr = srcDevice;
            last->dptr = dstDevice;
            last->n = ByteCount;
            last->src_version = cu.allocs[si].version;
            last->version = cu.allocs[di].version;
        }
        spent = now_ns() - began;
        pthread_mutex_unlock(&cu_mutex);
        if (d_ns >= 200000 && d_ns > spent) {
            long long left = d_ns - spent;
            struct timespec ts = {left / 1000000000LL, left % 1000000000LL};
            while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
                ;
        }
        pthread_mutex_lock(&cu_mutex);
        cu.device_ns += d_ns;
        pthread_mutex_unlock(&cu_mutex);
    }
    return CUDA_SUCCESS;
}

/* The stream's work completes in order before the call returns here: the same as cuMemcpyPeer on the null stream. */
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
                           CUstream hStream)
{
    if (hStream)
        return CUDA_ERROR_INVALID_HANDLE; /* only the null stream is modelled */
    return cuMemcpyPeer(dstDevice, dstContext, srcDevice, srcContext, ByteCount);
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int valid_event(CUevent e)
{
    return e && e >= cu.events && e < cu.events + MAX_EVENTS && e->used;
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phEvent || Flags > 0xF)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    for (int i = 0; i < MAX_EVENTS; i++)
        if (!cu.events[i].used) {
            cu.events[i].used = 1;
            cu.events[i].device = current->device;
            cu.events[i].timing = !(Flags & 0x2); /* CU_EVENT_DISABLE_TIMING */
            cu.events[i].ns = 0;
            *phEvent = &cu.events[i];
            return leave(CUDA_SUCCESS);
        }
    return leave(CUDA_ERROR_OUT_OF_MEMORY);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    CUresult rc = need_context();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (hStream)
        return CUDA_ERROR_INVALID_HANDLE; /* only the null stream is modelled */
    pthread_mutex_lock(&cu_mutex);
    if (!valid_event(hEvent))
        return leave(CUDA_ERROR_INVALID_HANDLE);
    hEvent->ns = cu.device_ns + 1; /* the work before it has completed already (+1: recorded, even before any work) */
    return leave(CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent hEvent)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_event(hEvent))
        return leave(CUDA_ERROR_INVALID_HANDLE);
    return leave(CUDA_SUCCESS);
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_event(hStart) || !valid_event(hEnd) || !hStart->timing || !hEnd->timing || !hStart->ns || !hEnd->ns)
        return leave(CUDA_ERROR_INVALID_HANDLE);
    *pMilliseconds = (float)((double)(hEnd->ns - hStart->ns) / 1e6);
    return leave(CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&cu_mutex);
    if (!valid_event(hEvent))
        return leave(CUDA_ERROR_INVALID_HANDLE);
    hEvent->used = 0;
    return leave(CUDA_SUCCESS);
}

CUresult cuEventDestroy(CUevent hEvent)
{
    return cuEventDestroy_v2(hEvent);
}

/* CUDA 12.8's name for it (cuda.h maps cuEventElapsedTime to it from CUDA 13 on); the old symbol stays for old binaries. */
CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return cuEventElapsedTime(pMilliseconds, hStart, hEnd);
}
