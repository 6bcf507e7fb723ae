/*
 * Running-process lists: compute, graphics and MPS, each in its three entry
 * point versions, with NVML's two-call count protocol; plus the newer
 * nvmlDeviceGetRunningProcessDetailList.
 *
 * Each context has a kind (the worker's --kind): compute contexts show in the compute
 * list, graphics ones (an X or Vulkan client) in the graphics list, MPS clients in the MPS
 * list. On a GPU in MIG mode every entry carries a GPU and compute instance id and, as
 * nvitop observes, no per-process memory (NVML_VALUE_NOT_AVAILABLE).
 */
#define _GNU_SOURCE
#include "sim.h"

#include <stdlib.h>
#include <string.h>

enum proc_kind { KIND_COMPUTE, KIND_GRAPHICS, KIND_MPS };

typedef struct {
    unsigned pid;
    unsigned long long bytes;
} proc_entry_t;

static proc_entry_t entries[SIM_MAX_CTX]; /* used under sim_mutex only */

/* Collect the visible entries for one GPU, one per owner pid (contexts of
 * the same pid are summed, as the driver reports per process). */
static int collect(unsigned gpu, enum proc_kind kind)
{
    static sim_ctx_t ctx[SIM_MAX_CTX];
    int n, count = 0;
    n = sim_ctx_scan(gpu, ctx, SIM_MAX_CTX);
    if (n > SIM_MAX_CTX)
        n = SIM_MAX_CTX;
    for (int i = 0; i < n; i++) {
        unsigned pid;
        int j;
        if (ctx[i].kind != (int)kind)
            continue;
        if (!sim_ctx_visible_pid(&ctx[i], &pid))
            continue; /* owner not visible from the caller's PID namespace */
        for (j = 0; j < count && entries[j].pid != pid; j++)
            ;
        if (j == count) {
            entries[count].pid = pid;
            entries[count].bytes = 0;
            count++;
        }
        entries[j].bytes += ctx[i].mib * 1024ULL * 1024ULL;
    }
    if (kind == KIND_COMPUTE) {
        /* phantom_pids fault: entries a skewed driver/binding reports, holding nothing. */
        const char *p = sim_cfg.phantom_pids;
        while (*p && count < SIM_MAX_CTX) {
            char *end;
            unsigned long g = strtoul(p, &end, 10), pid;
            if (end == p || *end != ':')
                break;
            p = end + 1;
            pid = strtoul(p, &end, 10);
            if (end == p)
                break;
            p = *end == ',' ? end + 1 : end;
            if (g == gpu) {
                entries[count].pid = (unsigned)pid;
                entries[count].bytes = 0;
                count++;
            }
        }
    }
    if (sim_cfg.memory_na || sim_cfg.gpus[gpu].mig_mode) /* MIG (or WDDM): per-process memory unknown */
        for (int i = 0; i < count; i++)
            entries[i].bytes = NVML_VALUE_NOT_AVAILABLE;
    return count;
}

static nvmlReturn_t list(const char *fn, int version, enum proc_kind kind, nvmlDevice_t device,
                         unsigned int *infoCount, void *infos)
{
    const sim_gpu_t *g;
    unsigned gi;
    int n;
    nvmlReturn_t rc = sim_enter_dev(fn, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    /* Older drivers lack the newer entry points (process_api fault). */
    if (version > sim_cfg.process_api)
        return sim_leave(NVML_ERROR_FUNCTION_NOT_FOUND);
    if (!infoCount)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    n = collect(device->index, kind);
    if (!infos || *infoCount < (unsigned)n) {
        *infoCount = (unsigned)n;
        return sim_leave(n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS);
    }
    gi = g->mig_mode ? 1 : 0xFFFFFFFFu; /* MIG off: no GPU/compute instance */
    for (int i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = entries[i].pid;
            p->usedGpuMemory = entries[i].bytes;
        } else {
            /* _v2 and _v3 share one layout in this nvml.h (nvmlProcessInfo_t is
             * nvmlProcessInfo_v2_t): the R535 v3 struct with a protected-memory
             * field was withdrawn; that figure lives in the detail list now. */
            nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
            p->pid = entries[i].pid;
            p->usedGpuMemory = entries[i].bytes;
            p->gpuInstanceId = gi;
            p->computeInstanceId = g->mig_mode ? 0 : gi;
        }
    }
    *infoCount = (unsigned)n;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos)
{
    return list(__func__, 1, KIND_COMPUTE, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos)
{
    return list(__func__, 2, KIND_COMPUTE, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    return list(__func__, 3, KIND_COMPUTE, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos)
{
    return list(__func__, 1, KIND_GRAPHICS, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos)
{
    return list(__func__, 2, KIND_GRAPHICS, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    return list(__func__, 3, KIND_GRAPHICS, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v1_t *infos)
{
    return list(__func__, 1, KIND_MPS, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_v2_t *infos)
{
    return list(__func__, 2, KIND_MPS, device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    return list(__func__, 3, KIND_MPS, device, infoCount, infos);
}

/* The newest interface: one call for every kind, with the v1 detail struct
 * (which carries usedGpuCcProtectedMemory, always 0 here: no CC mode).
 * Absent unless the process_api fault leaves the v3 generation in place. */
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    const sim_gpu_t *g;
    enum proc_kind kind;
    unsigned gi;
    int n;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (sim_cfg.process_api < 3)
        return sim_leave(NVML_ERROR_FUNCTION_NOT_FOUND);
    if (!plist || plist->version != nvmlProcessDetailList_v1 || plist->mode >= NVML_PROCESS_MODE_MAX)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    kind = plist->mode == NVML_PROCESS_MODE_GRAPHICS ? KIND_GRAPHICS
           : plist->mode == NVML_PROCESS_MODE_MPS    ? KIND_MPS
                                                     : KIND_COMPUTE;
    n = collect(device->index, kind);
    if (!plist->procArray || plist->numProcArrayEntries < (unsigned)n) {
        plist->numProcArrayEntries = (unsigned)n;
        return sim_leave(n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS);
    }
    gi = g->mig_mode ? 1 : 0xFFFFFFFFu;
    for (int i = 0; i < n; i++) {
        nvmlProcessDetail_v1_t *p = &plist->procArray[i];
        p->pid = entries[i].pid;
        p->usedGpuMemory = entries[i].bytes;
        p->gpuInstanceId = gi;
        p->computeInstanceId = g->mig_mode ? 0 : gi;
        p->usedGpuCcProtectedMemory = 0;
    }
    plist->numProcArrayEntries = (unsigned)n;
    return sim_leave(NVML_SUCCESS);
}
