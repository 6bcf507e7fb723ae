/*
 * node.conf: the node description written by gpusim (Python).
 *
 * Flat "key=value" lines; unknown keys are ignored so that the Python side can
 * grow the format without breaking older builds. gpusim replaces the file with
 * rename(), so a change is seen as a new inode and/or mtime: sim_config_refresh()
 * costs one stat() per call and re-parses only when the file changed, which is
 * how faults switched on at runtime reach a long-lived NVML client.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* Identity of the node.conf we last parsed. */
static struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} loaded;

static void copy_str(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src);
}

static unsigned long long parse_ull(const char *s)
{
    return strtoull(s, NULL, 0);
}

static int parse_bool(const char *s)
{
    return !(s[0] == '\0' || strcmp(s, "0") == 0 || strcasecmp(s, "false") == 0 || strcasecmp(s, "no") == 0);
}

/* Parse "DDDDDDDD:BB:DD.F" (domain optional) into the GPU's PCI fields. */
static void parse_bus_id(sim_gpu_t *g, const char *s)
{
    unsigned d = 0, b = 0, dv = 0, f = 0;
    if (sscanf(s, "%x:%x:%x.%x", &d, &b, &dv, &f) == 4 || (d = 0, sscanf(s, "%x:%x.%x", &b, &dv, &f) == 3)) {
        g->domain = d;
        g->bus = b;
        g->dev = dv;
    }
    snprintf(g->bus_id, sizeof g->bus_id, NVML_DEVICE_PCI_BUS_ID_FMT, g->domain, g->bus, g->dev);
}

/* "3,7" -> bits 3 and 7. */
static unsigned long long parse_links(const char *s)
{
    unsigned long long bits = 0;
    while (*s) {
        char *end;
        unsigned long i = strtoul(s, &end, 10);
        if (end == s) {
            s++;
            continue;
        }
        if (i < SIM_NVLINK_MAX)
            bits |= 1ULL << i;
        s = end;
    }
    return bits;
}

/* "link:count,link:count" -> one NVLink error counter of each link (the others 0). */
static void parse_link_counts(unsigned long long *out, const char *s)
{
    memset(out, 0, sizeof(unsigned long long) * SIM_NVLINK_MAX);
    while (*s) {
        char *end;
        unsigned long link = strtoul(s, &end, 10);
        if (end == s || *end != ':') {
            s = *end ? end + 1 : end;
            continue;
        }
        s = end + 1;
        unsigned long long n = strtoull(s, &end, 10);
        if (link < SIM_NVLINK_MAX)
            out[link] = n;
        s = end;
    }
}

static void set_gpu_key(sim_config_t *cfg, unsigned idx, const char *key, const char *val)
{
    sim_gpu_t *g;
    if (idx >= SIM_MAX_GPUS)
        return;
    g = &cfg->gpus[idx];
    if (strcmp(key, "name") == 0)
        copy_str(g->name, sizeof g->name, val);
    else if (strcmp(key, "uuid") == 0)
        copy_str(g->uuid, sizeof g->uuid, val);
    else if (strcmp(key, "pci_bus_id") == 0)
        parse_bus_id(g, val);
    else if (strcmp(key, "minor") == 0)
        g->minor = (unsigned)parse_ull(val);
    else if (strcmp(key, "total_mib") == 0)
        g->total_mib = parse_ull(val);
    else if (strcmp(key, "reserved_mib") == 0)
        g->reserved_mib = parse_ull(val);
    else if (strcmp(key, "orphan_mib") == 0)
        g->orphan_mib = parse_ull(val);
    else if (strcmp(key, "mig_mode") == 0)
        g->mig_mode = (unsigned)parse_ull(val);
    else if (strcmp(key, "recovery_action") == 0)
        g->recovery_action = (unsigned)parse_ull(val);
    else if (strcmp(key, "lost") == 0)
        g->lost = parse_bool(val);
    else if (strcmp(key, "features") == 0) {
        g->features = 0;
        if (strstr(val, "ecc"))
            g->features |= SIM_FEAT_ECC;
        if (strstr(val, "remap"))
            g->features |= SIM_FEAT_REMAP;
        if (strstr(val, "retired"))
            g->features |= SIM_FEAT_RETIRED;
        if (strstr(val, "fabric"))
            g->features |= SIM_FEAT_FABRIC;
        if (strstr(val, "mig"))
            g->features |= SIM_FEAT_MIG;
    } else if (strcmp(key, "persistence") == 0)
        g->persistence = parse_bool(val);
    else if (strcmp(key, "mig_pending") == 0)
        g->mig_pending = (unsigned)parse_ull(val);
    else if (strcmp(key, "remap_correctable") == 0)
        g->remap_corr = (unsigned)parse_ull(val);
    else if (strcmp(key, "remap_uncorrectable") == 0)
        g->remap_unc = (unsigned)parse_ull(val);
    else if (strcmp(key, "remap_pending") == 0)
        g->remap_pending = parse_bool(val);
    else if (strcmp(key, "remap_failure") == 0)
        g->remap_failure = parse_bool(val);
    else if (strcmp(key, "retired_sbe") == 0)
        g->retired_sbe = (unsigned)parse_ull(val);
    else if (strcmp(key, "retired_dbe") == 0)
        g->retired_dbe = (unsigned)parse_ull(val);
    else if (strcmp(key, "retired_pending") == 0)
        g->retired_pending = parse_bool(val);
    else if (strcmp(key, "ecc_volatile_uncorrected") == 0)
        g->ecc_volatile_unc = parse_ull(val);
    else if (strcmp(key, "fabric_state") == 0)
        g->fabric_state = (unsigned)parse_ull(val);
    else if (strcmp(key, "fabric_status") == 0)
        g->fabric_status = (unsigned)parse_ull(val);
    else if (strcmp(key, "inforom_corrupt") == 0)
        g->inforom_corrupt = parse_bool(val);
    else if (strcmp(key, "pci_device_id") == 0)
        g->pci_device_id = (unsigned)parse_ull(val);
    else if (strcmp(key, "nvlinks") == 0)
        g->nvlinks = (unsigned)parse_ull(val) > SIM_NVLINK_MAX ? SIM_NVLINK_MAX : (unsigned)parse_ull(val);
    else if (strcmp(key, "nvlink_version") == 0)
        g->nvlink_version = (unsigned)parse_ull(val);
    else if (strcmp(key, "nvlink_remote") == 0)
        g->nvlink_remote = (unsigned)parse_ull(val);
    else if (strcmp(key, "nvlink_down") == 0)
        g->nvlink_down = parse_links(val);
    else if (strcmp(key, "nvlink_replay") == 0)
        parse_link_counts(g->nvlink_err[NVML_NVLINK_ERROR_DL_REPLAY], val);
    else if (strcmp(key, "nvlink_recovery") == 0)
        parse_link_counts(g->nvlink_err[NVML_NVLINK_ERROR_DL_RECOVERY], val);
    else if (strcmp(key, "nvlink_crc_flit") == 0)
        parse_link_counts(g->nvlink_err[NVML_NVLINK_ERROR_DL_CRC_FLIT], val);
    else if (strcmp(key, "nvlink_crc_data") == 0)
        parse_link_counts(g->nvlink_err[NVML_NVLINK_ERROR_DL_CRC_DATA], val);
    else if (strcmp(key, "pcie_gen_gpu_max") == 0)
        g->pcie_gen_gpu_max = (unsigned)parse_ull(val);
    else if (strcmp(key, "pcie_gen_max") == 0)
        g->pcie_gen_max = (unsigned)parse_ull(val);
    else if (strcmp(key, "pcie_gen") == 0)
        g->pcie_gen = (unsigned)parse_ull(val);
    else if (strcmp(key, "pcie_gen_idle") == 0)
        g->pcie_gen_idle = (unsigned)parse_ull(val);
    else if (strcmp(key, "pcie_width_max") == 0)
        g->pcie_width_max = (unsigned)parse_ull(val);
    else if (strcmp(key, "pcie_width") == 0)
        g->pcie_width = (unsigned)parse_ull(val);
    else if (strcmp(key, "clocks_event_reasons") == 0)
        g->clocks_event_reasons = parse_ull(val);
    else if (strcmp(key, "temperature") == 0)
        g->temperature = (unsigned)parse_ull(val);
    else if (strcmp(key, "temp_limit") == 0)
        g->temp_limit = (unsigned)parse_ull(val);
    else if (strcmp(key, "pci_subsystem_id") == 0)
        g->pci_subsystem_id = (unsigned)parse_ull(val);
}

/* "1,3" -> mark those GPUs as selected by the timeout (or hang) fault; "" -> all. */
static void set_fault_gpus(sim_config_t *cfg, const char *val, int hang)
{
    const char *p = val;
    int any = 0;
    while (*p) {
        char *end;
        unsigned long i = strtoul(p, &end, 10);
        if (end == p) {
            p++;
            continue;
        }
        if (i < SIM_MAX_GPUS) {
            if (hang)
                cfg->gpus[i].hang = 1;
            else
                cfg->gpus[i].timeout = 1;
            any = 1;
        }
        p = end;
    }
    if (!any)
        for (unsigned i = 0; i < SIM_MAX_GPUS; i++) {
            if (hang)
                cfg->gpus[i].hang = 1;
            else
                cfg->gpus[i].timeout = 1;
        }
}

static void set_key(sim_config_t *cfg, const char *key, const char *val)
{
    if (strncmp(key, "gpu.", 4) == 0) {
        char *end;
        unsigned long idx = strtoul(key + 4, &end, 10);
        if (*end == '.')
            set_gpu_key(cfg, (unsigned)idx, end + 1, val);
    } else if (strcmp(key, "driver_version") == 0) {
        copy_str(cfg->driver_version, sizeof cfg->driver_version, val);
    } else if (strcmp(key, "nvml_version") == 0) {
        copy_str(cfg->nvml_version, sizeof cfg->nvml_version, val);
    } else if (strcmp(key, "cuda_driver_version") == 0) {
        cfg->cuda_driver_version = (int)parse_ull(val);
    } else if (strcmp(key, "fault.phantom_pids") == 0) {
        copy_str(cfg->phantom_pids, sizeof cfg->phantom_pids, val);
    } else if (strcmp(key, "context_overhead_mib") == 0) {
        cfg->context_overhead_mib = parse_ull(val);
    } else if (strcmp(key, "gpu_count") == 0) {
        unsigned long long n = parse_ull(val);
        cfg->gpu_count = n > SIM_MAX_GPUS ? SIM_MAX_GPUS : (unsigned)n;
    } else if (strcmp(key, "fault.init_error") == 0) {
        cfg->init_error = val[0] ? sim_error_from_name(val) : NVML_SUCCESS;
    } else if (strcmp(key, "fault.legacy_pids") == 0) {
        cfg->legacy_pids = parse_bool(val);
    } else if (strcmp(key, "fault.memory_v2_unsupported") == 0) {
        cfg->memory_v2_unsupported = parse_bool(val);
    } else if (strcmp(key, "fault.memory_na") == 0) {
        cfg->memory_na = parse_bool(val);
    } else if (strcmp(key, "fault.process_api") == 0) {
        int v = atoi(val[0] == 'v' || val[0] == 'V' ? val + 1 : val);
        cfg->process_api = (v >= 1 && v <= 3) ? v : 3;
    } else if (strcmp(key, "fault.timeout_functions") == 0) {
        if (val[0])
            snprintf(cfg->timeout_functions, sizeof cfg->timeout_functions, ",%s,", val);
    } else if (strcmp(key, "fault.timeout_gpus") == 0) {
        set_fault_gpus(cfg, val, 0);
    } else if (strcmp(key, "fault.hang_functions") == 0) {
        if (val[0])
            snprintf(cfg->hang_functions, sizeof cfg->hang_functions, ",%s,", val);
    } else if (strcmp(key, "fault.hang_gpus") == 0) {
        set_fault_gpus(cfg, val, 1);
    } else if (strcmp(key, "p2p.unsupported") == 0) {
        copy_str(cfg->p2p_unsupported, sizeof cfg->p2p_unsupported, val);
    } else if (strcmp(key, "fault.timeout_delay_ms") == 0) {
        cfg->timeout_delay_ms = (int)parse_ull(val);
    }
}

static char *trim(char *s)
{
    char *e;
    while (isspace((unsigned char)*s))
        s++;
    e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

/* Parse $state_dir/node.conf into *cfg. Returns 0, or -1 if it cannot be read. */
int sim_config_load(const char *state_dir, sim_config_t *cfg)
{
    char path[PATH_MAX + 16];
    char *buf, *line, *save = NULL;
    struct stat st;
    ssize_t n;
    size_t got = 0;
    int fd;
    int timeout_gpus_seen = 0;
    int hang_gpus_seen = 0;

    snprintf(path, sizeof path, "%s/node.conf", state_dir);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (fstat(fd, &st) < 0 || st.st_size > (1 << 20)) {
        close(fd);
        return -1;
    }
    buf = malloc((size_t)st.st_size + 1);
    if (!buf) {
        close(fd);
        return -1;
    }
    while (got < (size_t)st.st_size && (n = read(fd, buf + got, (size_t)st.st_size - got)) > 0)
        got += (size_t)n;
    buf[got] = '\0';
    close(fd);

    memset(cfg, 0, sizeof *cfg);
    for (unsigned i = 0; i < SIM_MAX_GPUS; i++) {
        /* A node.conf written before the health keys existed describes an HGX H200. */
        cfg->gpus[i].features = SIM_FEAT_ECC | SIM_FEAT_REMAP | SIM_FEAT_FABRIC | SIM_FEAT_MIG;
        cfg->gpus[i].persistence = 1;
        cfg->gpus[i].mig_pending = (unsigned)-1;
        cfg->gpus[i].fabric_state = NVML_GPU_FABRIC_STATE_COMPLETED;
        /* ... with 18 NVLink 4 links to the baseboard's NVSwitches, in a PCIe 5 x16 slot, idle at 44 C. */
        cfg->gpus[i].nvlinks = 18;
        cfg->gpus[i].nvlink_version = NVML_NVLINK_VERSION_4_0;
        cfg->gpus[i].nvlink_remote = NVML_NVLINK_DEVICE_TYPE_SWITCH;
        cfg->gpus[i].pcie_gen_gpu_max = cfg->gpus[i].pcie_gen_max = cfg->gpus[i].pcie_gen = 5;
        cfg->gpus[i].pcie_width_max = cfg->gpus[i].pcie_width = 16;
        cfg->gpus[i].temperature = 44;
        cfg->gpus[i].temp_limit = 87;
    }
    cfg->process_api = 3;
    cfg->cuda_driver_version = 13000;
    for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq, *key, *val;
        line = trim(line);
        if (line[0] == '#' || !(eq = strchr(line, '=')))
            continue;
        *eq = '\0';
        key = trim(line);
        val = trim(eq + 1);
        if (strcmp(key, "fault.timeout_gpus") == 0)
            timeout_gpus_seen = 1;
        if (strcmp(key, "fault.hang_gpus") == 0)
            hang_gpus_seen = 1;
        set_key(cfg, key, val);
    }
    free(buf);
    if (cfg->timeout_functions[0] && !timeout_gpus_seen)
        set_fault_gpus(cfg, "", 0);
    /* A hang with an empty GPU list hangs the call on every GPU (key order in node.conf does not matter). */
    if (cfg->hang_functions[0] && !hang_gpus_seen)
        set_fault_gpus(cfg, "", 1);

    loaded.valid = 1;
    loaded.dev = st.st_dev;
    loaded.ino = st.st_ino;
    loaded.size = st.st_size;
    loaded.mtime = st.st_mtim;
    return 0;
}

/* Re-read node.conf if it was replaced or modified since the last parse.
 * Called with sim_mutex held. A vanished file keeps the last description. */
void sim_config_refresh(void)
{
    char path[PATH_MAX + 16];
    struct stat st;
    sim_config_t *fresh;

    snprintf(path, sizeof path, "%s/node.conf", sim_state);
    if (stat(path, &st) < 0)
        return;
    if (loaded.valid && st.st_ino == loaded.ino && st.st_dev == loaded.dev && st.st_size == loaded.size &&
        st.st_mtim.tv_sec == loaded.mtime.tv_sec && st.st_mtim.tv_nsec == loaded.mtime.tv_nsec)
        return;
    fresh = malloc(sizeof *fresh);
    if (!fresh)
        return;
    if (sim_config_load(sim_state, fresh) == 0)
        memcpy(&sim_cfg, fresh, sizeof sim_cfg);
    free(fresh);
}

void sim_config_forget(void)
{
    loaded.valid = 0;
}

/* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION came with R550: older drivers answer the field with
 * NVML_ERROR_NOT_SUPPORTED in its own nvmlReturn. */
int sim_recovery_action_supported(void)
{
    return atoi(sim_cfg.driver_version) >= 550;
}
