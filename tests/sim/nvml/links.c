/*
 * What a tp=N start needs of its GPUs together (issue 39): NVLink links and their error counters, the PCIe link,
 * clock event reasons, temperature, and NVML's word on peer-to-peer between two GPUs.
 *
 * As the real driver answers (nvml.h's documented return codes):
 *
 *   - NVLink: a GPU without NVLink (a PCIe card) answers NVML_ERROR_NOT_SUPPORTED for every link; a link index the
 *     GPU does not have (an H100/H200 SXM has 18, an A100 12) is NVML_ERROR_INVALID_ARGUMENT; an inactive link reads
 *     NVML_FEATURE_DISABLED. The error counters count since the driver loaded (or the GPU was reset).
 *   - PCIe: the maximum generation is the lower of the GPU's and the slot's (nvmlDeviceGetMaxPcieLinkGeneration), the
 *     GPU's own is nvmlDeviceGetGpuMaxPcieLinkGeneration. An idle GPU lowers its link's generation to save power
 *     (gpu.N.pcie_gen_idle) and goes back up as soon as it has work: here, as soon as a context exists on it. The
 *     width is what the link trained at and does not drop at idle.
 *   - Clock event reasons: the node's bits (HW slowdown, thermal, power brake ...), and GpuIdle while no context
 *     exists (an idle H200 reads "Idle: Active" in nvidia-smi -q).
 *   - Temperature: the die's, the T.Limit (the maximum operating temperature; nvidia-smi -q prints the margin to it
 *     as "GPU T.Limit Temp") and the thresholds relative to it as the H200 prints them (slowdown 2 C past it,
 *     shutdown 8 C past it).
 *   - P2P: a pair the node lists in p2p.unsupported reads NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED for reads, writes,
 *     atomics and PCI; NVLink P2P is OK between two GPUs whose NVLinks reach the same NVSwitch fabric.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sim_gpu_busy(unsigned gpu)
{
    sim_ctx_t one[1];
    return sim_ctx_scan(gpu, one, 1) > 0;
}

int sim_pair_listed(const char *list, unsigned a, unsigned b)
{
    const char *p = list;
    while (p && *p) {
        char *end;
        unsigned long x = strtoul(p, &end, 10), y;
        if (end == p || *end != '-') {
            p = strchr(p, ',');
            p = p ? p + 1 : NULL;
            continue;
        }
        y = strtoul(end + 1, &end, 10);
        if ((x == a && y == b) || (x == b && y == a))
            return 1;
        p = strchr(end, ',');
        p = p ? p + 1 : NULL;
    }
    return 0;
}

/* ------------------------------------------------------------------- NVLink */

static nvmlReturn_t link_of(const sim_gpu_t *g, unsigned link)
{
    if (!g->nvlinks)
        return NVML_ERROR_NOT_SUPPORTED;
    return link < g->nvlinks ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = link_of(g, link)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!isActive)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = (g->nvlink_down >> link) & 1ULL ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = link_of(g, link)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!version)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *version = g->nvlink_version;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = link_of(g, link)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!pNvLinkDeviceType)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *pNvLinkDeviceType = (nvmlIntNvLinkDeviceType_t)g->nvlink_remote;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((rc = link_of(g, link)) != NVML_SUCCESS)
        return sim_leave(rc);
    if (!counterValue || counter >= NVML_NVLINK_ERROR_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* The data ECC counter is not modelled: 0, as on a link that never saw one. */
    *counterValue = (unsigned)counter < SIM_NVLINK_COUNTERS ? g->nvlink_err[counter][link] : 0;
    return sim_leave(NVML_SUCCESS);
}

/* --------------------------------------------------------------------- PCIe */

static nvmlReturn_t pcie_value(nvmlDevice_t device, const char *fn, unsigned which, unsigned int *out)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(fn, device, &g);
    unsigned v = 0;
    if (rc != NVML_SUCCESS)
        return rc;
    if (!out)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->pcie_gen_max)
        return sim_leave(NVML_ERROR_NOT_SUPPORTED); /* "if PCIe link information is not available" */
    switch (which) {
    case 0: /* current generation: lowered while idle, what the link trained at while busy */
        v = g->pcie_gen;
        if (g->pcie_gen_idle && g->pcie_gen_idle < v && !sim_gpu_busy(device->index))
            v = g->pcie_gen_idle;
        break;
    case 1:
        v = g->pcie_gen_max;
        break;
    case 2:
        v = g->pcie_gen_gpu_max;
        break;
    case 3:
        v = g->pcie_width;
        break;
    default:
        v = g->pcie_width_max;
        break;
    }
    *out = v;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen)
{
    return pcie_value(device, __func__, 0, currLinkGen);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen)
{
    return pcie_value(device, __func__, 1, maxLinkGen);
}

nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGenDevice)
{
    return pcie_value(device, __func__, 2, maxLinkGenDevice);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth)
{
    return pcie_value(device, __func__, 3, currLinkWidth);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth)
{
    return pcie_value(device, __func__, 4, maxLinkWidth);
}

/* ------------------------------------------------------------------- clocks */

static nvmlReturn_t event_reasons(nvmlDevice_t device, const char *fn, unsigned long long *reasons)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(fn, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!reasons)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = g->clocks_event_reasons | (sim_gpu_busy(device->index) ? 0ULL : (unsigned long long)nvmlClocksEventReasonGpuIdle);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons)
{
    return event_reasons(device, __func__, clocksEventReasons);
}

/* The name before R535 ("throttle reasons"), kept by the library. */
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *clocksThrottleReasons)
{
    return event_reasons(device, __func__, clocksThrottleReasons);
}

/* -------------------------------------------------------------- temperature */

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!temp || sensorType >= NVML_TEMPERATURE_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (sensorType != NVML_TEMPERATURE_GPU)
        return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *temp = g->temperature;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!temperature)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != nvmlTemperature_v1)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temperature->sensorType >= NVML_TEMPERATURE_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->sensorType != NVML_TEMPERATURE_GPU)
        return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    temperature->temperature = (int)g->temperature;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, nvmlTemperatureThresholds_t thresholdType, unsigned int *temp)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!temp || thresholdType >= NVML_TEMPERATURE_THRESHOLD_COUNT)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    switch (thresholdType) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        *temp = g->temp_limit + 8;
        break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        *temp = g->temp_limit + 2;
        break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX:
        *temp = g->temp_limit;
        break;
    default:
        return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMarginTemperature(nvmlDevice_t device, nvmlMarginTemperature_t *marginTempInfo)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!marginTempInfo)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (marginTempInfo->version != nvmlMarginTemperature_v1)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    marginTempInfo->marginTemperature = (int)g->temp_limit - (int)g->temperature;
    return sim_leave(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------- P2P */

static int nvlink_fabric(const sim_gpu_t *g)
{
    unsigned long long all = g->nvlinks >= 64 ? ~0ULL : ((1ULL << g->nvlinks) - 1);
    return g->nvlinks && g->nvlink_remote == NVML_NVLINK_DEVICE_TYPE_SWITCH && (g->nvlink_down & all) != all;
}

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device1, &g);
    uintptr_t off = (uintptr_t)device2 - (uintptr_t)sim_devices;
    const sim_gpu_t *h;
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device2 || off >= sizeof sim_devices || off % sizeof sim_devices[0] != 0 || device2->index >= sim_cfg.gpu_count || !p2pStatus ||
        p2pIndex >= NVML_P2P_CAPS_INDEX_UNKNOWN)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    h = &sim_cfg.gpus[device2->index];
    if (h->lost)
        return sim_leave(NVML_ERROR_GPU_IS_LOST);
    if (device1->index == device2->index)
        *p2pStatus = NVML_P2P_STATUS_NOT_SUPPORTED; /* a GPU with itself, as an H100 answered for every index */
    else if (sim_pair_listed(sim_cfg.p2p_unsupported, device1->index, device2->index))
        *p2pStatus = NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED;
    else if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK)
        *p2pStatus = nvlink_fabric(g) && nvlink_fabric(h) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    else
        *p2pStatus = NVML_P2P_STATUS_OK;
    return sim_leave(NVML_SUCCESS);
}
