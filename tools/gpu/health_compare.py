"""Do the module's health readings agree with nvidia-smi -q (and with pynvml read directly)?

    python3 tools/gpu/health_compare.py [--sim] [--out DIR]

For each GPU it reads the verdict's inputs three ways: gpu_mem_verify's ``gpus[i].health.readings``
(run through ansible-playbook on localhost, ``health: true``), ``nvidia-smi -q`` parsed, and pynvml
called directly (tools/gpu/nvml_raw.py, in its own process). It prints one table (reading x GPU x
source) and writes health-compare-<backend>.json with the raw -q text and every source's values.

"Not supported" is one value whichever way a source says it (N/A, an NVML NOT_SUPPORTED error,
None in the module, fabric state not_supported): a GPU without the feature agrees with itself.

When the module has no ``health`` option (before issue 12's verdict landed) the module column reads
"n/a (module has no health option)" and only nvidia-smi and pynvml are compared. Exit status 1
when two sources that both answered disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import typing as t
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UNSUPPORTED = "unsupported"
KEYS = [
    "recovery_action",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "retired_pages.single_bit",
    "retired_pages.double_bit",
    "retired_pages.pending",
    "ecc_volatile_uncorrected",
    "fabric.state",
    "fabric.status",
    "compute_mode",
    "mig_mode.current",
    "mig_mode.pending",
    "persistence_mode",
]


# ----------------------------------------------------------------------------- nvidia-smi -q
LINE = re.compile(r"^(\s*)(\S.*?)\s*: (.*)$")


def parse_q(text: str) -> list[dict[str, t.Any]]:
    """`nvidia-smi -q` as a tree: one dict per "GPU <bus id>" block; sections nest by indentation."""
    gpus: list[dict[str, t.Any]] = []
    stack: list[tuple[int, dict[str, t.Any]]] = []
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        if indent == 0:
            if raw.startswith("GPU "):
                gpu: dict[str, t.Any] = {"_bus_id": raw[4:].strip()}
                gpus.append(gpu)
                stack = [(0, gpu)]
            else:
                stack = []
            continue
        if not stack:
            continue
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        m = LINE.match(raw)
        if m:
            parent[m.group(2).strip()] = m.group(3).strip()
        else:
            section: dict[str, t.Any] = {}
            parent[raw.strip()] = section
            stack.append((indent, section))
    return gpus


def _na(v: t.Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip() in ("N/A", "[N/A]", "Not Supported", "[Not Supported]", "Unknown Error", ""))


def _int(v: t.Any) -> t.Any:
    if _na(v):
        return UNSUPPORTED
    try:
        return int(str(v).split()[0])
    except ValueError:
        return v


def _bool(v: t.Any) -> t.Any:
    if _na(v):
        return UNSUPPORTED
    s = str(v).strip().lower()
    if s in ("yes", "enabled", "on", "true"):
        return True
    if s in ("no", "disabled", "off", "false"):
        return False
    return v


SMI_RECOVERY = {
    "none": "none",
    "reset": "gpu_reset",
    "gpu reset": "gpu_reset",
    "reboot": "node_reboot",
    "node reboot": "node_reboot",
    "drain p2p": "drain_p2p",
    "drain and reset": "drain_and_reset",
}
SMI_FABRIC = {"not supported": "not_supported", "not started": "not_started", "in progress": "in_progress", "completed": "completed"}


def from_smi(g: dict[str, t.Any]) -> dict[str, t.Any]:
    def sec(name: str) -> dict[str, t.Any]:
        v = g.get(name)
        return v if isinstance(v, dict) else {}

    vol = sec("ECC Errors").get("Volatile")
    vol = vol if isinstance(vol, dict) else {}
    # Driver >= 550 splits SRAM and DRAM; older ones have "Double Bit" -> "Total".
    unc_keys = [k for k in vol if "Uncorrectable" in k]
    if unc_keys:
        vals = [_int(vol[k]) for k in unc_keys]
        nums = [v for v in vals if isinstance(v, int)]
        ecc = sum(nums) if nums else UNSUPPORTED
    elif isinstance(vol.get("Double Bit"), dict):
        ecc = _int(vol["Double Bit"].get("Total"))
    else:
        ecc = UNSUPPORTED
    rec = g.get("GPU Recovery Action")
    fab = sec("Fabric")
    state = fab.get("State")
    status = fab.get("Status")
    mode = g.get("Compute Mode")
    rr, rp, mig = sec("Remapped Rows"), sec("Retired Pages"), sec("MIG Mode")
    return {
        "recovery_action": UNSUPPORTED if _na(rec) else SMI_RECOVERY.get(str(rec).strip().lower(), rec),
        "remapped_rows.correctable": _int(rr.get("Correctable Error")),
        "remapped_rows.uncorrectable": _int(rr.get("Uncorrectable Error")),
        "remapped_rows.pending": _bool(rr.get("Pending")),
        "remapped_rows.failure": _bool(rr.get("Remapping Failure Occurred")),
        "retired_pages.single_bit": _int(rp.get("Single Bit ECC")),
        "retired_pages.double_bit": _int(rp.get("Double Bit ECC")),
        "retired_pages.pending": _bool(rp.get("Pending Page Blacklist", rp.get("Pending Page Retirement"))),
        "ecc_volatile_uncorrected": ecc,
        "fabric.state": UNSUPPORTED if _na(state) else SMI_FABRIC.get(str(state).strip().lower(), state),
        "fabric.status": UNSUPPORTED if _na(status) else (0 if str(status).strip().lower() == "success" else status),
        "compute_mode": UNSUPPORTED if _na(mode) else str(mode).strip().lower(),
        "mig_mode.current": _bool(mig.get("Current")),
        "mig_mode.pending": _bool(mig.get("Pending")),
        "persistence_mode": _bool(g.get("Persistence Mode")),
    }


def from_readings(r: dict[str, t.Any] | None) -> dict[str, t.Any]:
    """The interface's readings (the module's, or nvml_raw's) flattened; errors and None are unsupported."""
    out: dict[str, t.Any] = {}
    r = r or {}
    for key in KEYS:
        top, _dot, sub = key.partition(".")
        v = r.get(top)
        if isinstance(v, dict) and "error" in v:
            v = None
        if sub:
            v = v.get(sub) if isinstance(v, dict) else None
        out[key] = UNSUPPORTED if v is None else v
    # A fabric that is not supported has no status either.
    if out["fabric.state"] in (UNSUPPORTED, "not_supported"):
        out["fabric.state"] = UNSUPPORTED
        out["fabric.status"] = UNSUPPORTED
    if out["fabric.state"] != "completed" and out["fabric.status"] not in (UNSUPPORTED,):
        out["fabric.status"] = UNSUPPORTED  # nvidia-smi prints a status only once the probe completed
    return out


# ----------------------------------------------------------------------------- the three sources
def module_has_health() -> bool:
    import yaml

    src = (ROOT / "plugins" / "modules" / "gpu_mem_verify.py").read_text()
    doc = re.search(r'DOCUMENTATION = r?"""(.*?)"""', src, re.S)
    return bool(doc) and "health" in (yaml.safe_load(doc.group(1)) or {}).get("options", {})


def compare(backend: t.Any, ansible: t.Any) -> dict[str, t.Any]:
    env = dict(os.environ)
    env.update(backend.env)
    q = subprocess.run([backend.smi, "-q"], env=env, capture_output=True, text=True, check=False)
    smi = [from_smi(g) for g in parse_q(q.stdout)]
    raw = subprocess.run([sys.executable, str(HERE / "nvml_raw.py")], env=env, capture_output=True, text=True, check=False)
    try:
        nvml = json.loads(raw.stdout)
    except ValueError:
        nvml = {"error": raw.stdout[-2000:] + raw.stderr[-2000:], "gpus": []}
    pyn = [from_readings(g["readings"]) for g in nvml.get("gpus", [])]
    has = module_has_health()
    mod: list[dict[str, t.Any] | None] = []
    module_note = ""
    args: dict[str, t.Any] = {"expected_count": backend.count, "device_dir": backend.device_dir}
    if has:
        args.update(health=True, fail_on="never")
    rc, _wall, records, text = ansible.run(ansible.play([{"name": "verify", "gpuops.clean_slate.gpu_mem_verify": args}]))
    verify = [r for r in records if r.get("task", "").endswith("verify")]
    result = verify[-1]["result"] if verify else {}
    if not has:
        module_note = "n/a (module has no health option)"
    elif not verify or rc != 0:
        module_note = f"n/a (gpu_mem_verify failed: {result.get('reason')} {result.get('msg', text[-300:])})"
    for g in result.get("gpus", []) if has else []:
        mod.append(from_readings((g.get("health") or {}).get("readings")))
    count = max(len(smi), len(pyn))
    rows = []
    disagree = []
    for i in range(count):
        for key in KEYS:
            vals = {
                "nvidia-smi": smi[i][key] if i < len(smi) else "missing",
                "pynvml": pyn[i][key] if i < len(pyn) else "missing",
                "module": (mod[i][key] if i < len(mod) and mod[i] is not None else module_note or "missing"),
            }
            answered = [v for s, v in vals.items() if not (s == "module" and module_note)]
            agree = all(v == answered[0] for v in answered)
            rows.append({"gpu": i, "reading": key, **vals, "agree": agree})
            if not agree:
                disagree.append(f"GPU {i} {key}: {vals}")
    return {
        "module_has_health": has,
        "module_note": module_note,
        "module_health": result.get("health"),
        "module_gpus_health": [g.get("health") for g in result.get("gpus", [])],
        "smi_rc": q.returncode,
        "smi_q": q.stdout,
        "smi_parsed": parse_q(q.stdout),
        "nvml_raw": nvml,
        "rows": rows,
        "disagree": disagree,
    }


def format_table(data: dict[str, t.Any]) -> str:
    lines = ["| GPU | reading | nvidia-smi -q | pynvml | module | agree |", "|---:|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['gpu']} | {r['reading']} | {r['nvidia-smi']} | {r['pynvml']} | {r['module']} | {'yes' if r['agree'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    import validate  # beside this script: its folder is sys.path[0] when it runs as a script

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", action="store_true")
    p.add_argument("--sim-gpus", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    a = p.parse_args()
    backend = validate.SimBackend(a.sim_gpus) if a.sim else validate.RealBackend()
    try:
        with tempfile.TemporaryDirectory(prefix="gpuops-health-") as tmp:
            data = compare(backend, validate.Ansible(backend, Path(tmp)))
    finally:
        if a.sim:
            backend.node.stop()
    print(format_table(data))
    for d in data["disagree"]:
        print("DISAGREE", d)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"health-compare-{backend.name}.json").write_text(json.dumps(data, indent=1, default=str))
    return 1 if data["disagree"] else 0


if __name__ == "__main__":
    sys.exit(main())
