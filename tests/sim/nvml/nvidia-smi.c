/*
 * nvidia-smi look-alike for the simulated node: a C program (fast to exec,
 * like the real one) that loads libnvidia-ml.so.1 with dlopen exactly as the
 * real nvidia-smi does, so LD_LIBRARY_PATH and the library's faults decide.
 *
 *   nvidia-smi                          short status table
 *   nvidia-smi -L                       "GPU 0: NVIDIA H200 (UUID: GPU-...)"
 *   nvidia-smi --query-gpu=F,... --format=csv[,noheader][,nounits] [-i LIST]
 *   nvidia-smi --query-compute-apps=F,... --format=csv[,noheader][,nounits]
 *   nvidia-smi -q [-i LIST]             the health-related parts of the full report, in its layout
 *
 * Exit status follows the real tool, which returns the NVML error code:
 * 0 ok, 2 bad arguments, 9 driver not loaded, 12 library not found,
 * 15 a GPU is lost, 18 driver/library mismatch, else the init error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <nvml.h>

#define MIB (1024ULL * 1024ULL)
#define MAX_GPUS 64
#define MAX_FIELDS 32
#define MAX_PROCS 512

/* The NVML entry points we use, typed from nvml.h's own prototypes. */
#define NVML_FUNCS(X)                                                                                        \
    X(nvmlInit_v2)                                                                                           \
    X(nvmlShutdown)                                                                                          \
    X(nvmlErrorString)                                                                                       \
    X(nvmlSystemGetDriverVersion)                                                                            \
    X(nvmlSystemGetCudaDriverVersion_v2)                                                                     \
    X(nvmlSystemGetProcessName)                                                                              \
    X(nvmlDeviceGetCount_v2)                                                                                 \
    X(nvmlDeviceGetHandleByIndex_v2)                                                                         \
    X(nvmlDeviceGetName)                                                                                     \
    X(nvmlDeviceGetUUID)                                                                                     \
    X(nvmlDeviceGetPciInfo_v3)                                                                               \
    X(nvmlDeviceGetMemoryInfo)                                                                               \
    X(nvmlDeviceGetMemoryInfo_v2)                                                                            \
    X(nvmlDeviceGetPersistenceMode)                                                                          \
    X(nvmlDeviceGetComputeMode)                                                                              \
    X(nvmlDeviceGetMigMode)                                                                                  \
    X(nvmlDeviceGetComputeRunningProcesses)                                                                  \
    X(nvmlDeviceGetComputeRunningProcesses_v2)                                                               \
    X(nvmlDeviceGetComputeRunningProcesses_v3)                                                               \
    X(nvmlDeviceGetEccMode)                                                                                  \
    X(nvmlDeviceGetTotalEccErrors)                                                                           \
    X(nvmlDeviceGetRetiredPages)                                                                             \
    X(nvmlDeviceGetRetiredPagesPendingStatus)                                                                \
    X(nvmlDeviceGetRemappedRows)                                                                             \
    X(nvmlDeviceGetGpuFabricInfoV)                                                                           \
    X(nvmlDeviceGetFieldValues)                                                                              \
    X(nvmlDeviceGetCurrPcieLinkGeneration)                                                                   \
    X(nvmlDeviceGetMaxPcieLinkGeneration)                                                                    \
    X(nvmlDeviceGetGpuMaxPcieLinkGeneration)                                                                 \
    X(nvmlDeviceGetCurrPcieLinkWidth)                                                                        \
    X(nvmlDeviceGetMaxPcieLinkWidth)                                                                         \
    X(nvmlDeviceGetCurrentClocksEventReasons)                                                                \
    X(nvmlDeviceGetTemperatureV)                                                                             \
    X(nvmlDeviceGetTemperatureThreshold)                                                                     \
    X(nvmlDeviceGetMarginTemperature)                                                                        \
    X(nvmlDeviceGetNvLinkState)                                                                              \
    X(nvmlDeviceGetNvLinkVersion)                                                                            \
    X(nvmlDeviceGetNvLinkErrorCounter)

#define DECLARE(f) static __typeof__(&f) p_##f;
NVML_FUNCS(DECLARE)

static void *load_library(void)
{
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib)
        return NULL;
#define LOAD(f) *(void **)&p_##f = dlsym(lib, #f);
    NVML_FUNCS(LOAD)
    return lib;
}

/* ------------------------------------------------------------- GPU info */

typedef struct {
    unsigned index;
    nvmlReturn_t rc; /* handle lookup result */
    nvmlDevice_t dev;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    int have_v2;
    unsigned long long total, used, reserved, free;
} gpu_t;

static gpu_t gpus[MAX_GPUS];
static unsigned ngpus, device_count;
static int lost_seen;
static char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];

static void load_gpu(gpu_t *g, unsigned index)
{
    nvmlPciInfo_t pci;
    nvmlMemory_v2_t m2;
    nvmlMemory_t m1;
    memset(g, 0, sizeof *g);
    g->index = index;
    g->rc = p_nvmlDeviceGetHandleByIndex_v2(index, &g->dev);
    if (g->rc != NVML_SUCCESS) {
        if (g->rc == NVML_ERROR_GPU_IS_LOST)
            lost_seen = 1;
        return;
    }
    p_nvmlDeviceGetName(g->dev, g->name, sizeof g->name);
    p_nvmlDeviceGetUUID(g->dev, g->uuid, sizeof g->uuid);
    if (p_nvmlDeviceGetPciInfo_v3(g->dev, &pci) == NVML_SUCCESS)
        snprintf(g->bus_id, sizeof g->bus_id, "%s", pci.busId);
    /* memory.used is v2 "used" (allocations only); v1 is the fallback on old drivers */
    m2.version = nvmlMemory_v2;
    if (p_nvmlDeviceGetMemoryInfo_v2 && p_nvmlDeviceGetMemoryInfo_v2(g->dev, &m2) == NVML_SUCCESS) {
        g->have_v2 = 1;
        g->total = m2.total;
        g->used = m2.used;
        g->reserved = m2.reserved;
        g->free = m2.free;
    } else if (p_nvmlDeviceGetMemoryInfo(g->dev, &m1) == NVML_SUCCESS) {
        g->total = m1.total;
        g->used = m1.used;
        g->free = m1.free;
    }
}

static void lost_message(const gpu_t *g)
{
    if (g->rc == NVML_ERROR_GPU_IS_LOST)
        printf("Unable to determine the device handle for GPU%u: GPU is lost.  Reboot the system to recover "
               "this GPU\n",
               g->index);
    else
        printf("Unable to determine the device handle for GPU%u: %s\n", g->index, p_nvmlErrorString(g->rc));
}

/* "-i 0,3" / "--id=GPU-..." selection; empty = all. */
static int select_gpus(const char *ids)
{
    char buf[1024], *tok, *save = NULL;
    ngpus = 0;
    if (!ids) {
        for (unsigned i = 0; i < device_count && ngpus < MAX_GPUS; i++)
            load_gpu(&gpus[ngpus++], i);
        return 0;
    }
    snprintf(buf, sizeof buf, "%s", ids);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        unsigned long i = strtoul(tok, &end, 10);
        if (*end == '\0' && i < device_count) {
            load_gpu(&gpus[ngpus++], (unsigned)i);
            continue;
        }
        /* a UUID or bus id: match against the loaded devices */
        int found = 0;
        for (unsigned j = 0; j < device_count && !found; j++) {
            gpu_t g;
            load_gpu(&g, j);
            if (g.rc == NVML_SUCCESS && (strcasecmp(g.uuid, tok) == 0 || strcasecmp(g.bus_id, tok) == 0)) {
                gpus[ngpus++] = g;
                found = 1;
            }
        }
        if (!found) {
            printf("No devices were found\n");
            return 6;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ formatting */

typedef struct {
    int header, units;
} fmt_t;

static void print_mib(char *out, size_t size, unsigned long long bytes, const fmt_t *f)
{
    snprintf(out, size, f->units ? "%llu MiB" : "%llu", bytes / MIB);
}

static int parse_format(const char *spec, fmt_t *f)
{
    char buf[256], *tok, *save = NULL;
    int csv = 0;
    f->header = 1;
    f->units = 1;
    snprintf(buf, sizeof buf, "%s", spec);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (strcmp(tok, "csv") == 0)
            csv = 1;
        else if (strcmp(tok, "noheader") == 0)
            f->header = 0;
        else if (strcmp(tok, "nounits") == 0)
            f->units = 0;
        else
            return -1;
    }
    return csv ? 0 : -1;
}

static int split_fields(const char *list, char fields[MAX_FIELDS][64])
{
    char buf[1024], *tok, *save = NULL;
    int n = 0;
    snprintf(buf, sizeof buf, "%s", list);
    for (tok = strtok_r(buf, ",", &save); tok && n < MAX_FIELDS; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        snprintf(fields[n++], 64, "%s", tok);
    }
    return n;
}

static void invalid_field(const char *name)
{
    printf("Field \"%s\" is not a valid field to query.\n\n", name);
}

/* Canonical header for a --query-gpu field, or NULL if unknown. */
static const char *gpu_header(const char *f)
{
    static const char *map[][2] = {
        {"index", "index"},
        {"name", "name"},
        {"gpu_name", "name"},
        {"uuid", "uuid"},
        {"gpu_uuid", "uuid"},
        {"pci.bus_id", "pci.bus_id"},
        {"gpu_bus_id", "pci.bus_id"},
        {"memory.used", "memory.used [MiB]"},
        {"memory.total", "memory.total [MiB]"},
        {"memory.reserved", "memory.reserved [MiB]"},
        {"memory.free", "memory.free [MiB]"},
        {"driver_version", "driver_version"},
        {"count", "count"},
        {"persistence_mode", "persistence_mode"},
        {"compute_mode", "compute_mode"},
        {"mig.mode.current", "mig.mode.current"},
        {"mig.mode.pending", "mig.mode.pending"},
        {"pcie.link.gen.current", "pcie.link.gen.current"},
        {"pcie.link.gen.max", "pcie.link.gen.max"},
        {"pcie.link.gen.gpumax", "pcie.link.gen.gpumax"},
        {"pcie.link.width.current", "pcie.link.width.current"},
        {"pcie.link.width.max", "pcie.link.width.max"},
        {"clocks_event_reasons.active", "clocks_event_reasons.active"},
        {"temperature.gpu", "temperature.gpu"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(f, map[i][0]) == 0)
            return map[i][1];
    return NULL;
}

static void gpu_value(const gpu_t *g, const char *f, const fmt_t *fmt, char *out, size_t size)
{
    const char *h = gpu_header(f);
    if (strcmp(h, "index") == 0)
        snprintf(out, size, "%u", g->index);
    else if (strcmp(h, "name") == 0)
        snprintf(out, size, "%s", g->name);
    else if (strcmp(h, "uuid") == 0)
        snprintf(out, size, "%s", g->uuid);
    else if (strcmp(h, "pci.bus_id") == 0)
        snprintf(out, size, "%s", g->bus_id);
    else if (strncmp(h, "memory.used", 11) == 0)
        print_mib(out, size, g->used, fmt);
    else if (strncmp(h, "memory.total", 12) == 0)
        print_mib(out, size, g->total, fmt);
    else if (strncmp(h, "memory.reserved", 15) == 0) {
        if (g->have_v2)
            print_mib(out, size, g->reserved, fmt);
        else
            snprintf(out, size, "[N/A]");
    } else if (strncmp(h, "memory.free", 11) == 0)
        print_mib(out, size, g->free, fmt);
    else if (strcmp(h, "driver_version") == 0)
        snprintf(out, size, "%s", driver_version);
    else if (strcmp(h, "count") == 0)
        snprintf(out, size, "%u", device_count);
    else if (strcmp(h, "persistence_mode") == 0) {
        nvmlEnableState_t m;
        snprintf(out, size, "%s",
                 p_nvmlDeviceGetPersistenceMode(g->dev, &m) != NVML_SUCCESS ? "[N/A]"
                 : m == NVML_FEATURE_ENABLED                                 ? "Enabled"
                                                                             : "Disabled");
    } else if (strcmp(h, "compute_mode") == 0) {
        nvmlComputeMode_t m;
        static const char *names[] = {"Default", "Exclusive_Thread", "Prohibited", "Exclusive_Process"};
        nvmlReturn_t rc = p_nvmlDeviceGetComputeMode(g->dev, &m);
        snprintf(out, size, "%s", rc == NVML_SUCCESS && (unsigned)m < 4 ? names[m] : "[N/A]");
    } else if (strncmp(h, "pcie.link.", 10) == 0) {
        unsigned v = 0;
        nvmlReturn_t rc = strcmp(h, "pcie.link.gen.current") == 0   ? p_nvmlDeviceGetCurrPcieLinkGeneration(g->dev, &v)
                          : strcmp(h, "pcie.link.gen.max") == 0     ? p_nvmlDeviceGetMaxPcieLinkGeneration(g->dev, &v)
                          : strcmp(h, "pcie.link.gen.gpumax") == 0  ? p_nvmlDeviceGetGpuMaxPcieLinkGeneration(g->dev, &v)
                          : strcmp(h, "pcie.link.width.current") == 0 ? p_nvmlDeviceGetCurrPcieLinkWidth(g->dev, &v)
                                                                      : p_nvmlDeviceGetMaxPcieLinkWidth(g->dev, &v);
        if (rc == NVML_SUCCESS)
            snprintf(out, size, "%u", v);
        else
            snprintf(out, size, "[N/A]");
    } else if (strcmp(h, "clocks_event_reasons.active") == 0) {
        unsigned long long mask = 0;
        if (p_nvmlDeviceGetCurrentClocksEventReasons(g->dev, &mask) == NVML_SUCCESS)
            snprintf(out, size, "0x%016llX", mask);
        else
            snprintf(out, size, "[N/A]");
    } else if (strcmp(h, "temperature.gpu") == 0) {
        nvmlTemperature_t t;
        memset(&t, 0, sizeof t);
        t.version = nvmlTemperature_v1;
        t.sensorType = NVML_TEMPERATURE_GPU;
        if (p_nvmlDeviceGetTemperatureV(g->dev, &t) == NVML_SUCCESS)
            snprintf(out, size, "%d", t.temperature);
        else
            snprintf(out, size, "[N/A]");
    } else if (strncmp(h, "mig.mode.", 9) == 0) {
        unsigned cur, pend;
        if (p_nvmlDeviceGetMigMode(g->dev, &cur, &pend) != NVML_SUCCESS)
            snprintf(out, size, "[N/A]");
        else
            snprintf(out, size, "%s", (strcmp(h, "mig.mode.current") == 0 ? cur : pend) ? "Enabled" : "Disabled");
    }
}

static int query_gpu(const char *list, const fmt_t *fmt)
{
    char fields[MAX_FIELDS][64], value[256];
    int n = split_fields(list, fields);
    for (int i = 0; i < n; i++)
        if (!gpu_header(fields[i])) {
            invalid_field(fields[i]);
            return 2;
        }
    if (fmt->header)
        for (int i = 0; i < n; i++)
            printf("%s%s", gpu_header(fields[i]), i + 1 < n ? ", " : "\n");
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        if (g->rc != NVML_SUCCESS) {
            lost_message(g);
            continue;
        }
        for (int i = 0; i < n; i++) {
            gpu_value(g, fields[i], fmt, value, sizeof value);
            printf("%s%s", value, i + 1 < n ? ", " : "\n");
        }
    }
    return 0;
}

/* ------------------------------------------------------------- processes */

typedef struct {
    unsigned pid;
    unsigned long long mem;
} proc_t;

/* Newest process API first, falling back like NVML clients do on old drivers. */
static int get_procs(nvmlDevice_t dev, proc_t *out, unsigned max)
{
    nvmlProcessInfo_t v2[MAX_PROCS];
    nvmlProcessInfo_v1_t v1[MAX_PROCS];
    unsigned n = MAX_PROCS;
    nvmlReturn_t rc = p_nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, v2);
    if (rc == NVML_ERROR_FUNCTION_NOT_FOUND) {
        n = MAX_PROCS;
        rc = p_nvmlDeviceGetComputeRunningProcesses_v2(dev, &n, v2);
    }
    if (rc == NVML_ERROR_FUNCTION_NOT_FOUND) {
        n = MAX_PROCS;
        rc = p_nvmlDeviceGetComputeRunningProcesses(dev, &n, v1);
        if (rc != NVML_SUCCESS)
            return -1;
        for (unsigned i = 0; i < n && i < max; i++) {
            out[i].pid = v1[i].pid;
            out[i].mem = v1[i].usedGpuMemory;
        }
        return (int)(n < max ? n : max);
    }
    if (rc != NVML_SUCCESS)
        return -1;
    for (unsigned i = 0; i < n && i < max; i++) {
        out[i].pid = v2[i].pid;
        out[i].mem = v2[i].usedGpuMemory;
    }
    return (int)(n < max ? n : max);
}

static void process_name(unsigned pid, char *out, size_t size)
{
    char name[1024];
    if (p_nvmlSystemGetProcessName(pid, name, sizeof name) == NVML_SUCCESS)
        snprintf(out, size, "%s", name);
    else
        snprintf(out, size, "[Not Found]");
}

static const char *app_header(const char *f)
{
    static const char *map[][2] = {
        {"pid", "pid"},
        {"process_name", "process_name"},
        {"name", "process_name"},
        {"used_memory", "used_gpu_memory [MiB]"},
        {"used_gpu_memory", "used_gpu_memory [MiB]"},
        {"gpu_uuid", "gpu_uuid"},
        {"gpu_bus_id", "gpu_bus_id"},
        {"gpu_name", "gpu_name"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(f, map[i][0]) == 0)
            return map[i][1];
    return NULL;
}

static int query_apps(const char *list, const fmt_t *fmt)
{
    char fields[MAX_FIELDS][64], value[1100];
    static proc_t procs[MAX_PROCS];
    int n = split_fields(list, fields);
    for (int i = 0; i < n; i++)
        if (!app_header(fields[i])) {
            invalid_field(fields[i]);
            return 2;
        }
    if (fmt->header)
        for (int i = 0; i < n; i++)
            printf("%s%s", app_header(fields[i]), i + 1 < n ? ", " : "\n");
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        int np;
        if (g->rc != NVML_SUCCESS) {
            lost_message(g);
            continue;
        }
        np = get_procs(g->dev, procs, MAX_PROCS);
        for (int p = 0; p < np; p++) {
            for (int i = 0; i < n; i++) {
                const char *h = app_header(fields[i]);
                if (strcmp(h, "pid") == 0)
                    snprintf(value, sizeof value, "%u", procs[p].pid);
                else if (strcmp(h, "process_name") == 0)
                    process_name(procs[p].pid, value, sizeof value);
                else if (strncmp(h, "used_gpu_memory", 15) == 0) {
                    if (procs[p].mem == (unsigned long long)NVML_VALUE_NOT_AVAILABLE)
                        snprintf(value, sizeof value, "[N/A]");
                    else
                        print_mib(value, sizeof value, procs[p].mem, fmt);
                } else if (strcmp(h, "gpu_uuid") == 0)
                    snprintf(value, sizeof value, "%s", g->uuid);
                else if (strcmp(h, "gpu_bus_id") == 0)
                    snprintf(value, sizeof value, "%s", g->bus_id);
                else
                    snprintf(value, sizeof value, "%s", g->name);
                printf("%s%s", value, i + 1 < n ? ", " : "\n");
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------ plain views */

static void list_gpus(void)
{
    for (unsigned k = 0; k < ngpus; k++) {
        if (gpus[k].rc != NVML_SUCCESS)
            lost_message(&gpus[k]);
        else
            printf("GPU %u: %s (UUID: %s)\n", gpus[k].index, gpus[k].name, gpus[k].uuid);
    }
}

static void table(void)
{
    static proc_t procs[MAX_PROCS];
    char stamp[64], name[1024];
    int cuda = 0, any = 0;
    time_t now = time(NULL);
    const char *line = "+-----------------------------------------+------------------------+----------------------+";

    strftime(stamp, sizeof stamp, "%a %b %e %H:%M:%S %Y", localtime(&now));
    p_nvmlSystemGetCudaDriverVersion_v2(&cuda);
    printf("%s       \n", stamp);
    printf("+-----------------------------------------------------------------------------------------+\n");
    snprintf(name, sizeof name, "NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %d.%d", driver_version,
             driver_version, cuda / 1000, (cuda % 1000) / 10);
    printf("| %-87s |\n", name);
    printf("%s\n", line);
    printf("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n");
    printf("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |\n");
    printf("|                                         |                        |               MIG M. |\n");
    printf("|=========================================+========================+======================|\n");
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        char mem[64];
        if (g->rc != NVML_SUCCESS) {
            printf("| %3u  %-82s |\n", g->index, g->rc == NVML_ERROR_GPU_IS_LOST ? "GPU is lost" : "ERR!");
            printf("%s\n", line);
            continue;
        }
        snprintf(mem, sizeof mem, "%lluMiB / %lluMiB", g->used / MIB, g->total / MIB);
        printf("| %3u  %-28.28s   On  |   %16s Off |                    0 |\n", g->index, g->name, g->bus_id);
        printf("| %-39s | %22s |      0%%      Default |\n", "N/A   N/A    P0             N/A  /  N/A", mem);
        printf("|                                         |                        |             Disabled |\n");
        printf("%s\n", line);
    }
    printf("\n+-----------------------------------------------------------------------------------------+\n");
    printf("| Processes:                                                                              |\n");
    printf("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |\n");
    printf("|        ID   ID                                                               Usage      |\n");
    printf("|=========================================================================================|\n");
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        int np = g->rc == NVML_SUCCESS ? get_procs(g->dev, procs, MAX_PROCS) : 0;
        for (int p = 0; p < np; p++) {
            char memtxt[32];
            process_name(procs[p].pid, name, sizeof name);
            if (procs[p].mem == (unsigned long long)NVML_VALUE_NOT_AVAILABLE)
                snprintf(memtxt, sizeof memtxt, "N/A");
            else
                snprintf(memtxt, sizeof memtxt, "%lluMiB", procs[p].mem / MIB);
            printf("|  %4u   N/A  N/A  %14u      C   %-34.34s %10s |\n", g->index, procs[p].pid, name, memtxt);
            any = 1;
        }
    }
    if (!any)
        printf("|  No running processes found                                                             |\n");
    printf("+-----------------------------------------------------------------------------------------+\n");
}

/* ------------------------------------------------------------ -q report */

/* "key : value" with the colon in column 55, as the real report (driver 580) aligns it at every depth. */
#define Q_COLON 55
static void q_line(int depth, const char *key, const char *value)
{
    int indent = 4 * depth;
    printf("%*s%-*s: %s\n", indent, "", Q_COLON - indent, key, value);
}

static void q_section(int depth, const char *title)
{
    printf("%*s%s\n", 4 * depth, "", title);
}

static const char *enabled(nvmlEnableState_t s)
{
    return s == NVML_FEATURE_ENABLED ? "Enabled" : "Disabled";
}

static const char *yes_no(unsigned v)
{
    return v ? "Yes" : "No";
}


static void q_number(int depth, const char *key, nvmlReturn_t rc, unsigned v, const char *unit)
{
    char buf[64];
    if (rc == NVML_SUCCESS)
        snprintf(buf, sizeof buf, "%u%s", v, unit);
    else
        snprintf(buf, sizeof buf, "N/A");
    q_line(depth, key, buf);
}

/* The PCI section's link info, as driver 580 prints it (docs/results/nvidia-smi-q-h200x1-2026-12-01.txt). */
static void q_pci(const gpu_t *g)
{
    unsigned v = 0;
    nvmlReturn_t rc;
    q_section(1, "PCI");
    q_line(2, "Bus Id", g->bus_id);
    q_section(2, "GPU Link Info");
    q_section(3, "PCIe Generation");
    rc = p_nvmlDeviceGetMaxPcieLinkGeneration(g->dev, &v);
    q_number(4, "Max", rc, v, "");
    rc = p_nvmlDeviceGetCurrPcieLinkGeneration(g->dev, &v);
    q_number(4, "Current", rc, v, "");
    q_number(4, "Device Current", rc, v, "");
    rc = p_nvmlDeviceGetGpuMaxPcieLinkGeneration(g->dev, &v);
    q_number(4, "Device Max", rc, v, "");
    q_line(4, "Host Max", "N/A");
    q_section(3, "Link Width");
    rc = p_nvmlDeviceGetMaxPcieLinkWidth(g->dev, &v);
    q_number(4, "Max", rc, v, "x");
    rc = p_nvmlDeviceGetCurrPcieLinkWidth(g->dev, &v);
    q_number(4, "Current", rc, v, "x");
}

static void q_clocks_event_reasons(const gpu_t *g)
{
    static const struct {
        int depth;
        const char *name;
        unsigned long long bit;
    } reasons[] = {
        {2, "Idle", 0x1ULL},
        {2, "Applications Clocks Setting", 0x2ULL},
        {2, "SW Power Cap", 0x4ULL},
        {2, "HW Slowdown", 0x8ULL},
        {3, "HW Thermal Slowdown", 0x40ULL},
        {3, "HW Power Brake Slowdown", 0x80ULL},
        {2, "Sync Boost", 0x10ULL},
        {2, "SW Thermal Slowdown", 0x20ULL},
        {2, "Display Clock Setting", 0x100ULL},
    };
    unsigned long long mask = 0;
    nvmlReturn_t rc = p_nvmlDeviceGetCurrentClocksEventReasons(g->dev, &mask);
    q_section(1, "Clocks Event Reasons");
    for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
        q_line(reasons[i].depth, reasons[i].name, rc != NVML_SUCCESS ? "N/A" : (mask & reasons[i].bit) ? "Active" : "Not Active");
}

/* Hopper prints the thresholds relative to T.Limit, as the H200 did: the margin, then each threshold's offset from it. */
static void q_temperature(const gpu_t *g)
{
    unsigned limit = 0, shutdown = 0, slowdown = 0;
    nvmlTemperature_t temp;
    nvmlMarginTemperature_t margin;
    char buf[64];
    int have_limit;
    nvmlReturn_t rc;
    q_section(1, "Temperature");
    memset(&temp, 0, sizeof temp);
    temp.version = nvmlTemperature_v1;
    temp.sensorType = NVML_TEMPERATURE_GPU;
    rc = p_nvmlDeviceGetTemperatureV(g->dev, &temp);
    q_number(2, "GPU Current Temp", rc, (unsigned)temp.temperature, " C");
    memset(&margin, 0, sizeof margin);
    margin.version = nvmlMarginTemperature_v1;
    if (p_nvmlDeviceGetMarginTemperature(g->dev, &margin) == NVML_SUCCESS)
        snprintf(buf, sizeof buf, "%d C", margin.marginTemperature);
    else
        snprintf(buf, sizeof buf, "N/A");
    q_line(2, "GPU T.Limit Temp", buf);
    have_limit = p_nvmlDeviceGetTemperatureThreshold(g->dev, NVML_TEMPERATURE_THRESHOLD_GPU_MAX, &limit) == NVML_SUCCESS;
    if (have_limit && p_nvmlDeviceGetTemperatureThreshold(g->dev, NVML_TEMPERATURE_THRESHOLD_SHUTDOWN, &shutdown) == NVML_SUCCESS)
        snprintf(buf, sizeof buf, "%d C", (int)limit - (int)shutdown);
    else
        snprintf(buf, sizeof buf, "N/A");
    q_line(2, "GPU Shutdown T.Limit Temp", buf);
    if (have_limit && p_nvmlDeviceGetTemperatureThreshold(g->dev, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, &slowdown) == NVML_SUCCESS)
        snprintf(buf, sizeof buf, "%d C", (int)limit - (int)slowdown);
    else
        snprintf(buf, sizeof buf, "N/A");
    q_line(2, "GPU Slowdown T.Limit Temp", buf);
    q_line(2, "GPU Max Operating T.Limit Temp", have_limit ? "0 C" : "N/A");
    q_line(2, "GPU Target Temperature", "N/A");
}

/* nvidia-smi nvlink -s (each link's speed, or <inactive>) and -e (each link's error counters). */
static int nvlink_report(int errors)
{
    /* GB/s a link of each nvmlNvlinkVersion_t runs at, as nvidia-smi prints it (an H100's NVLink 4 link: 26.562). */
    static const char *speed[] = {"", "20.000", "25.781", "25.781", "25.781", "25.781", "26.562", "53.125"};
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        if (g->rc != NVML_SUCCESS) {
            lost_message(g);
            continue;
        }
        {
            /* A GPU without NVLink in use (a PCIe card, an SXM module alone in a VM) is not listed at all, header
             * included: an H100 passed through alone printed nothing (docs/results/round4-facts-h100x1-2026-12-05.json). */
            nvmlEnableState_t first;
            if (p_nvmlDeviceGetNvLinkState(g->dev, 0, &first) != NVML_SUCCESS)
                continue;
        }
        printf("GPU %u: %s (UUID: %s)\n", g->index, g->name, g->uuid);
        for (unsigned link = 0; link < NVML_NVLINK_MAX_LINKS; link++) {
            nvmlEnableState_t active;
            unsigned version = 0;
            if (p_nvmlDeviceGetNvLinkState(g->dev, link, &active) != NVML_SUCCESS)
                break;
            if (errors) {
                static const char *names[] = {"Replay Errors", "Recovery Errors", "CRC Errors", "Data CRC Errors"};
                for (unsigned c = 0; c < 4; c++) {
                    unsigned long long n = 0;
                    if (p_nvmlDeviceGetNvLinkErrorCounter(g->dev, link, (nvmlNvLinkErrorCounter_t)c, &n) == NVML_SUCCESS)
                        printf("\t Link %u: %s: %llu\n", link, names[c], n);
                }
            } else if (active != NVML_FEATURE_ENABLED) {
                printf("\t Link %u: <inactive>\n", link);
            } else {
                p_nvmlDeviceGetNvLinkVersion(g->dev, link, &version);
                printf("\t Link %u: %s GB/s\n", link, version < sizeof speed / sizeof speed[0] ? speed[version] : "N/A");
            }
        }
    }
    return 0;
}

/* The sections the health verdict reads, in the order and wording of the real `nvidia-smi -q`
 * (driver 580); anything the library does not support prints N/A, as the real tool does. */
static void query_report(void)
{
    char stamp[64], buf[128];
    time_t now = time(NULL);
    int cuda = 0;
    strftime(stamp, sizeof stamp, "%a %b %e %H:%M:%S %Y", localtime(&now));
    p_nvmlSystemGetCudaDriverVersion_v2(&cuda);
    printf("\n==============NVSMI LOG==============\n\n");
    printf("%-*s: %s\n", Q_COLON, "Timestamp", stamp);
    printf("%-*s: %s\n", Q_COLON, "Driver Version", driver_version);
    printf("%-*s: %d.%d\n\n", Q_COLON, "CUDA Version", cuda / 1000, (cuda % 1000) / 10);
    printf("%-*s: %u\n", Q_COLON, "Attached GPUs", device_count);
    for (unsigned k = 0; k < ngpus; k++) {
        const gpu_t *g = &gpus[k];
        nvmlEnableState_t cur, pend;
        unsigned a, b, c, d, count;
        unsigned long long n;
        nvmlComputeMode_t mode;
        if (g->rc != NVML_SUCCESS) {
            lost_message(g);
            continue;
        }
        printf("GPU %s\n", g->bus_id);
        q_line(1, "Product Name", g->name);
        q_line(1, "Persistence Mode", p_nvmlDeviceGetPersistenceMode(g->dev, &cur) == NVML_SUCCESS ? enabled(cur) : "N/A");
        q_section(1, "MIG Mode");
        if (p_nvmlDeviceGetMigMode(g->dev, &a, &b) == NVML_SUCCESS) {
            q_line(2, "Current", a ? "Enabled" : "Disabled");
            q_line(2, "Pending", b ? "Enabled" : "Disabled");
        } else {
            q_line(2, "Current", "N/A");
            q_line(2, "Pending", "N/A");
        }
        q_line(1, "GPU UUID", g->uuid);
        q_pci(g);
        q_clocks_event_reasons(g);
        q_section(1, "ECC Mode");
        if (p_nvmlDeviceGetEccMode && p_nvmlDeviceGetEccMode(g->dev, &cur, &pend) == NVML_SUCCESS) {
            q_line(2, "Current", enabled(cur));
            q_line(2, "Pending", enabled(pend));
        } else {
            q_line(2, "Current", "N/A");
            q_line(2, "Pending", "N/A");
        }
        q_section(1, "ECC Errors");
        q_section(2, "Volatile");
        /* The real report splits SRAM and DRAM; the simulated library keeps one total, shown as DRAM. */
        q_line(3, "SRAM Correctable", "N/A");
        q_line(3, "SRAM Uncorrectable Parity", "N/A");
        q_line(3, "SRAM Uncorrectable SEC-DED", "N/A");
        if (p_nvmlDeviceGetTotalEccErrors &&
            p_nvmlDeviceGetTotalEccErrors(g->dev, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC, &n) == NVML_SUCCESS)
            snprintf(buf, sizeof buf, "%llu", n);
        else
            snprintf(buf, sizeof buf, "N/A");
        q_line(3, "DRAM Correctable", buf);
        if (p_nvmlDeviceGetTotalEccErrors &&
            p_nvmlDeviceGetTotalEccErrors(g->dev, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, &n) == NVML_SUCCESS)
            snprintf(buf, sizeof buf, "%llu", n);
        else
            snprintf(buf, sizeof buf, "N/A");
        q_line(3, "DRAM Uncorrectable", buf);
        q_section(1, "Retired Pages");
        count = 0;
        if (p_nvmlDeviceGetRetiredPages &&
            p_nvmlDeviceGetRetiredPages(g->dev, NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, &count, NULL) == NVML_SUCCESS) {
            snprintf(buf, sizeof buf, "%u", count);
            q_line(2, "Single Bit ECC", buf);
            count = 0;
            p_nvmlDeviceGetRetiredPages(g->dev, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, &count, NULL);
            snprintf(buf, sizeof buf, "%u", count);
            q_line(2, "Double Bit ECC", buf);
        } else {
            q_line(2, "Single Bit ECC", "N/A");
            q_line(2, "Double Bit ECC", "N/A");
        }
        if (p_nvmlDeviceGetRetiredPagesPendingStatus && p_nvmlDeviceGetRetiredPagesPendingStatus(g->dev, &cur) == NVML_SUCCESS)
            q_line(2, "Pending Page Blacklist", yes_no(cur == NVML_FEATURE_ENABLED));
        else
            q_line(2, "Pending Page Blacklist", "N/A");
        q_section(1, "Remapped Rows");
        if (p_nvmlDeviceGetRemappedRows && p_nvmlDeviceGetRemappedRows(g->dev, &a, &b, &c, &d) == NVML_SUCCESS) {
            snprintf(buf, sizeof buf, "%u", a);
            q_line(2, "Correctable Error", buf);
            q_line(2, "Inactive Correctable Error", "0");
            snprintf(buf, sizeof buf, "%u", b);
            q_line(2, "Uncorrectable Error", buf);
            q_line(2, "Inactive Uncorrectable Error", "0");
            q_line(2, "Pending", yes_no(c));
            q_line(2, "Remapping Failure Occurred", yes_no(d));
        } else {
            q_line(2, "Correctable Error", "N/A");
            q_line(2, "Inactive Correctable Error", "N/A");
            q_line(2, "Uncorrectable Error", "N/A");
            q_line(2, "Inactive Uncorrectable Error", "N/A");
            q_line(2, "Pending", "N/A");
            q_line(2, "Remapping Failure Occurred", "N/A");
        }
        q_temperature(g);
        q_section(1, "Fabric");
        {
            nvmlGpuFabricInfoV_t fi;
            memset(&fi, 0, sizeof fi);
            fi.version = nvmlGpuFabricInfo_v3;
            if (p_nvmlDeviceGetGpuFabricInfoV && p_nvmlDeviceGetGpuFabricInfoV(g->dev, &fi) == NVML_SUCCESS &&
                fi.state != NVML_GPU_FABRIC_STATE_NOT_SUPPORTED) {
                static const char *states[] = {"N/A", "Not Started", "In Progress", "Completed"};
                q_line(2, "State", fi.state < 4 ? states[fi.state] : "Unknown");
                q_line(2, "Status", fi.state != NVML_GPU_FABRIC_STATE_COMPLETED ? "N/A"
                                    : fi.status == NVML_SUCCESS                ? "Success"
                                                                               : p_nvmlErrorString(fi.status));
            } else {
                q_line(2, "State", "N/A");
                q_line(2, "Status", "N/A");
            }
        }
        mode = NVML_COMPUTEMODE_DEFAULT;
        if (p_nvmlDeviceGetComputeMode(g->dev, &mode) == NVML_SUCCESS)
            q_line(1, "Compute Mode", mode == NVML_COMPUTEMODE_PROHIBITED          ? "Prohibited"
                                      : mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS ? "Exclusive_Process"
                                                                                   : "Default");
        else
            q_line(1, "Compute Mode", "N/A");
        {
            nvmlFieldValue_t fv;
            memset(&fv, 0, sizeof fv);
            fv.fieldId = NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;
            if (p_nvmlDeviceGetFieldValues && p_nvmlDeviceGetFieldValues(g->dev, 1, &fv) == NVML_SUCCESS &&
                fv.nvmlReturn == NVML_SUCCESS) {
                static const char *actions[] = {"None", "Reset", "Reboot", "Drain P2P", "Drain and Reset"};
                unsigned v = fv.value.uiVal;
                q_line(1, "GPU Recovery Action", v < 5 ? actions[v] : "Unknown");
            } else {
                q_line(1, "GPU Recovery Action", "N/A");
            }
        }
        printf("\n");
    }
}

static void usage(void)
{
    printf("NVIDIA System Management Interface -- gpusim look-alike\n\n"
           "    nvidia-smi [-i LIST] [-L | -q | --query-gpu=... | --query-compute-apps=...] [--format=csv[,noheader][,nounits]]\n");
}

int main(int argc, char **argv)
{
    const char *query_gpu_list = NULL, *query_apps_list = NULL, *format = NULL, *ids = NULL;
    int list = 0, query = 0, nvlink = 0, rc;
    fmt_t fmt;
    nvmlReturn_t nrc;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-L") == 0 || strcmp(a, "--list-gpus") == 0)
            list = 1;
        else if (i == 1 && strcmp(a, "nvlink") == 0)
            nvlink = 1; /* nvidia-smi nvlink -s | -e */
        else if (nvlink && (strcmp(a, "-s") == 0 || strcmp(a, "--status") == 0))
            nvlink = 1;
        else if (nvlink && (strcmp(a, "-e") == 0 || strcmp(a, "--errorcounters") == 0))
            nvlink = 2;
        else if (strcmp(a, "-q") == 0 || strcmp(a, "--query") == 0)
            query = 1;
        else if (strncmp(a, "--query-gpu=", 12) == 0)
            query_gpu_list = a + 12;
        else if (strncmp(a, "--query-compute-apps=", 21) == 0)
            query_apps_list = a + 21;
        else if (strncmp(a, "--format=", 9) == 0)
            format = a + 9;
        else if (strncmp(a, "--id=", 5) == 0)
            ids = a + 5;
        else if ((strcmp(a, "-i") == 0 || strcmp(a, "--id") == 0) && i + 1 < argc)
            ids = argv[++i];
        else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage();
            return 0;
        } else {
            printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
            return 2;
        }
    }
    if ((query_gpu_list || query_apps_list) && (!format || parse_format(format, &fmt) < 0)) {
        printf("%s\n\n", format ? "Invalid format option." : "Option --format is required for query options.");
        return 2;
    }

    if (!load_library()) {
        printf("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
               "NVIDIA Display Driver is properly installed and present in your system.\nPlease also try adding "
               "directory that contains libnvidia-ml.so to your system PATH.\n");
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    }
    nrc = p_nvmlInit_v2();
    if (nrc == NVML_ERROR_DRIVER_NOT_LOADED) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
               "latest NVIDIA driver is installed and running.\n\n");
        return nrc;
    }
    if (nrc == NVML_ERROR_LIB_RM_VERSION_MISMATCH) {
        printf("Failed to initialize NVML: Driver/library version mismatch\n");
        return nrc;
    }
    if (nrc != NVML_SUCCESS) {
        printf("Failed to initialize NVML: %s\n", p_nvmlErrorString(nrc));
        return nrc;
    }
    p_nvmlSystemGetDriverVersion(driver_version, sizeof driver_version);
    p_nvmlDeviceGetCount_v2(&device_count);
    rc = select_gpus(ids);
    if (rc == 0) {
        if (query_gpu_list)
            rc = query_gpu(query_gpu_list, &fmt);
        else if (query_apps_list)
            rc = query_apps(query_apps_list, &fmt);
        else if (nvlink)
            rc = nvlink_report(nvlink == 2);
        else if (list)
            list_gpus();
        else if (query)
            query_report();
        else
            table();
    }
    p_nvmlShutdown();
    if (rc == 0 && lost_seen)
        rc = NVML_ERROR_GPU_IS_LOST;
    return rc;
}
