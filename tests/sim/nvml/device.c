/*
 * Device enumeration and per-device queries: handles, identity, PCI, memory,
 * modes and field values.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>

#define MIB (1024ULL * 1024ULL)

/* ------------------------------------------------------------------ handles */

static nvmlReturn_t get_count(const char *fn, unsigned int *deviceCount)
{
    nvmlReturn_t rc = sim_enter(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned map[SIM_MAX_GPUS];
    if (!deviceCount)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = sim_visible(map);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    return get_count(__func__, deviceCount);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return get_count(__func__, deviceCount);
}

/* Hand out the handle of GPU `index` (sim_mutex held; releases it).
 * A lost GPU cannot be attached: the lookup itself fails. */
static nvmlReturn_t hand_out(const char *fn, unsigned index, nvmlDevice_t *device)
{
    const sim_gpu_t *g = &sim_cfg.gpus[index];
    if (g->lost)
        return sim_leave(NVML_ERROR_GPU_IS_LOST);
    sim_leave(NVML_SUCCESS);
    /* Re-enter through the per-device path so the timeout fault applies. */
    nvmlReturn_t rc = sim_enter_dev(fn, &sim_devices[index], &g);
    if (rc != NVML_SUCCESS)
        return rc;
    sim_device_open(index);
    *device = &sim_devices[index];
    return sim_leave(NVML_SUCCESS);
}

static nvmlReturn_t by_index(const char *fn, unsigned int index, nvmlDevice_t *device)
{
    unsigned map[SIM_MAX_GPUS], n;
    nvmlReturn_t rc = sim_enter(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    n = sim_visible(map);
    if (!device || index >= n)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    return hand_out(fn, map[index], device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return by_index(__func__, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return by_index(__func__, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = sim_enter(__func__);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!uuid || !device)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned map[SIM_MAX_GPUS], n = sim_visible(map);
    for (unsigned k = 0; k < n; k++)
        if (strcasecmp(sim_cfg.gpus[map[k]].uuid, uuid) == 0)
            return hand_out(__func__, map[k], device);
    return sim_leave(NVML_ERROR_NOT_FOUND);
}

/* Accepts "DDDDDDDD:BB:DD.F", "DDDD:BB:DD.F" and "BB:DD.F", any case. */
static nvmlReturn_t by_bus_id(const char *fn, const char *pciBusId, nvmlDevice_t *device)
{
    unsigned d = 0, b, dv, f;
    nvmlReturn_t rc = sim_enter(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pciBusId || !device)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (sscanf(pciBusId, "%x:%x:%x.%x", &d, &b, &dv, &f) != 4) {
        d = 0; /* a partial match above may have stored into d */
        if (sscanf(pciBusId, "%x:%x.%x", &b, &dv, &f) != 3)
            return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    unsigned map[SIM_MAX_GPUS], n = sim_visible(map);
    for (unsigned k = 0; k < n; k++) {
        const sim_gpu_t *g = &sim_cfg.gpus[map[k]];
        if (g->domain == d && g->bus == b && g->dev == dv)
            return hand_out(fn, map[k], device);
    }
    return sim_leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    return by_bus_id(__func__, pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return by_bus_id(__func__, pciBusId, device);
}

/* ----------------------------------------------------------------- identity */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    return sim_leave(sim_copy_string(name, length, g->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    return sim_leave(sim_copy_string(uuid, length, g->uuid));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned map[SIM_MAX_GPUS], n = sim_visible(map);
    if (!index)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* NVML's index: the GPU's place among those it lists (node.conf's, unless a device file hides one). */
    for (unsigned k = 0; k < n; k++)
        if (map[k] == device->index) {
            *index = k;
            return sim_leave(NVML_SUCCESS);
        }
    *index = device->index;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!minorNumber)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *minorNumber = g->minor;
    return sim_leave(NVML_SUCCESS);
}

/* --------------------------------------------------------------------- PCI */

static nvmlReturn_t pci_info(const char *fn, nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(fn, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, g->domain & 0xffff,
             g->bus, g->dev);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->dev;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info(__func__, device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info(__func__, device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info(__func__, device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci)
{
    const sim_gpu_t *g;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (pci->version != nvmlPciInfoExt_v1)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->dev;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    pci->baseClass = 0x03; /* display controller */
    pci->subClass = 0x02;  /* 3D controller, as data-centre GPUs report */
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id);
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ memory */

/* v1: "used" is reserved + allocated (the idle-GPU trap: 615 MiB on an H200). */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    const sim_gpu_t *g;
    unsigned long long used;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!memory)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    used = g->reserved_mib + g->orphan_mib + sim_ctx_used_mib(device->index);
    if (used > g->total_mib)
        used = g->total_mib;
    memory->total = g->total_mib * MIB;
    memory->used = used * MIB;
    memory->free = (g->total_mib - used) * MIB;
    return sim_leave(NVML_SUCCESS);
}

/* v2: "used" is what contexts allocated; reserved is reported on its own. */
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    const sim_gpu_t *g;
    unsigned long long used, avail;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (sim_cfg.memory_v2_unsupported)
        return sim_leave(NVML_ERROR_FUNCTION_NOT_FOUND); /* as on drivers before R510 */
    if (!memory)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    avail = g->total_mib > g->reserved_mib ? g->total_mib - g->reserved_mib : 0;
    used = g->orphan_mib + sim_ctx_used_mib(device->index);
    if (used > avail)
        used = avail;
    memory->total = g->total_mib * MIB;
    memory->reserved = g->reserved_mib * MIB;
    memory->used = used * MIB;
    memory->free = (avail - used) * MIB;
    return sim_leave(NVML_SUCCESS);
}

/* The modes (compute, MIG, persistence) are in health.c. */

/* ------------------------------------------------------------ field values */

/* Only the recovery action is modelled (from driver R550 on); every other field reports
 * NOT_SUPPORTED in its own nvmlReturn while the call itself succeeds. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    const sim_gpu_t *g;
    struct timeval tv;
    long long stamp;
    nvmlReturn_t rc = sim_enter_dev(__func__, device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!values || valuesCount < 0)
        return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    gettimeofday(&tv, NULL);
    stamp = (long long)tv.tv_sec * 1000000LL + tv.tv_usec;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = stamp;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && sim_recovery_action_supported()) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->recovery_action;
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT && g->nvlinks) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->nvlinks;
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return sim_leave(NVML_SUCCESS);
}
