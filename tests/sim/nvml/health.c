/*
 * Health queries (issue 12): recovery state, memory errors, NVLink fabric and the modes a job can
 * leave behind. What a GPU model does not have (gpu.N.features in node.conf, derived from its name
 * by gpusim) answers NVML_ERROR_NOT_SUPPORTED, as the real driver does: no ECC counters or row
 * remapping on a consumer GPU, no page retirement from Ampere on (row remapping replaced it), no
 * fabric state before Hopper.
 *
 * The compute mode is the one setting a client may change (nvmlDeviceSetComputeMode, root only, as
 * for the real driver); it lives in $GPUSIM_STATE/compute_mode.<index>, so that a change made by one
 * process is what every other one reads, as it is for a real GPU.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static nvmlReturn_t feature(const sim_gpu_t *g, unsigned f)
{
    return (g->features & f) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------- memory errors */

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_REMAP)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = g->remap_corr;
    *uncRows = g->remap_unc;
    *isPending = g->remap_pending;
    *failureOccurred = g->remap_failure;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_RETIRED)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!isPending)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *isPending = g->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

/* Two-call protocol like the process lists: *pageCount is the room, set to what there is. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                                       unsigned long long *addresses)
{
    const sim_gpu_t *g;
    unsigned n;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_RETIRED)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!pageCount || cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    n = cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? g->retired_dbe : g->retired_sbe;
    if (*pageCount < n || (n && !addresses)) {
        *pageCount = n;
        return sim_leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < n; i++)
        addresses[i] = 0x1000ULL * (i + 1) + (cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? 0x100000ULL : 0);
    *pageCount = n;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType, nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_ECC)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!eccCounts || errorType >= NVML_MEMORY_ERROR_TYPE_COUNT || counterType >= NVML_ECC_COUNTER_TYPE_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* Only uncorrected errors are modelled; the aggregate count includes the volatile one. */
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? g->ecc_volatile_unc : 0;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------- fabric */

static void fill_fabric(const sim_gpu_t *g, unsigned char *uuid, nvmlReturn_t *status, unsigned *clique,
                        nvmlGpuFabricState_t *state)
{
    memset(uuid, 0, NVML_GPU_FABRIC_UUID_LEN);
    if (g->fabric_state == NVML_GPU_FABRIC_STATE_COMPLETED)
        uuid[0] = 0x5a, uuid[15] = 0xa5; /* one cluster for the node's GPUs */
    *status = (nvmlReturn_t)g->fabric_status;
    *clique = g->fabric_state == NVML_GPU_FABRIC_STATE_COMPLETED ? 1 : 0; /* one clique: one NVSwitch baseboard */
    *state = (nvmlGpuFabricState_t)g->fabric_state;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_FABRIC)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!info)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    fill_fabric(g, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_FABRIC)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!info)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* v2 and v3 share their prefix; v3 adds healthSummary at the end. */
    if (info->version != nvmlGpuFabricInfo_v2 && info->version != nvmlGpuFabricInfo_v3)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    fill_fabric(g, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    info->healthMask = 0;
    if (info->version == nvmlGpuFabricInfo_v3)
        info->healthSummary = g->fabric_state == NVML_GPU_FABRIC_STATE_COMPLETED && g->fabric_status == NVML_SUCCESS
                                  ? NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
                                  : NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED;
    return sim_leave(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- modes */

static void mode_path(char *out, size_t size, unsigned index)
{
    snprintf(out, size, "%s/compute_mode.%u", sim_state, index);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    const sim_gpu_t *g;
    char path[PATH_MAX + 32], buf[16] = "";
    int fd;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mode)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *mode = NVML_COMPUTEMODE_DEFAULT;
    mode_path(path, sizeof path, device->index);
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) >= 0) {
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n > 0) {
            buf[n] = '\0';
            *mode = (nvmlComputeMode_t)atoi(buf);
        }
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode)
{
    const sim_gpu_t *g;
    char path[PATH_MAX + 32], tmp[PATH_MAX + 48], buf[16];
    int fd, len;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (mode >= NVML_COMPUTEMODE_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
        return sim_leave(NVML_ERROR_NOT_SUPPORTED); /* removed from the driver (CUDA 8) */
    if (geteuid() != 0)
        return sim_leave(NVML_ERROR_NO_PERMISSION); /* "Requires root/admin permissions" (nvml.h) */
    mode_path(path, sizeof path, device->index);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    len = snprintf(buf, sizeof buf, "%d\n", (int)mode);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return sim_leave(NVML_ERROR_UNKNOWN);
    if (write(fd, buf, (size_t)len) != len || close(fd) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return sim_leave(NVML_ERROR_UNKNOWN);
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mode)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *mode = g->persistence ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_MIG)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!currentMode || !pendingMode)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = g->mig_mode;
    *pendingMode = g->mig_pending == (unsigned)-1 ? g->mig_mode : g->mig_pending;
    return sim_leave(NVML_SUCCESS);
}

/* The infoROM's checksum (DCGM's level-1 "inforom" check): data-centre GPUs answer, a corrupted one says so. */
nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t device)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = feature(g, SIM_FEAT_ECC)) != NVML_SUCCESS)
        return sim_leave(rc);
    return sim_leave(g->inforom_corrupt ? NVML_ERROR_CORRUPTED_INFOROM : NVML_SUCCESS);
}
