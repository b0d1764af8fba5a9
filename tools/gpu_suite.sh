#!/usr/bin/env bash
# The GPU test suite (`pytest -m "gpu or traced"`) as a fresh machine runs it, timed (issue 27 item 5: under 5 minutes
# on one H200). "traced": CPU tests of compiled against eager, run here too because the GPU machines have another torch
# than CI (2.11 against 2.13): torch 2.11's dynamo traced the SiTU activation's autograd Function wrong, which only these
# tests, run under 2.11, showed on a CPU (docs/scaling.md, section 4f).
#
#   bash tools/gpu_suite.sh              # the suite, one process: the measurement
#   bash tools/gpu_suite.sh -n 4 --dist loadfile   # extra arguments go to pytest: 4 pytest-xdist workers, a file each
#                                        # (the suite's time is mostly Triton compiling kernels, one CPU core each)
#   bash tools/gpu_suite.sh -k "kda or kernels"    # a -k expression narrows the run
#   GPU_SUITE_LIMIT_S=300 bash tools/gpu_suite.sh  # stop pytest after this many seconds (default 500, inside a
#                                                  # 9-minute call): it is interrupted, still prints its slowest steps
#
# Triton's and TorchInductor's caches point at new empty folders, so every kernel compiles as on a fresh machine
# (conftest.py still restores fla's recorded autotuning into it, and pins every Triton autotuner to one
# configuration: K3LAB_PIN_AUTOTUNE=0 in the environment measures the unpinned suite). Prints pytest's 25 slowest
# steps, the seconds per test file, and the total wall time; exits with pytest's status. Where $OUT is set (the
# device runner's output folder) the log and the junit XML are written there, else into the temporary folder,
# which is removed at the end unless GPU_SUITE_KEEP=1.
set -uo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d "${TMPDIR:-/tmp}/k3lab-gpu-suite.XXXXXX")"
report="${OUT:-$work}"
mkdir -p "$report" "$work/triton" "$work/inductor"
[ "${GPU_SUITE_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
export TRITON_CACHE_DIR="$work/triton" TORCHINDUCTOR_CACHE_DIR="$work/inductor"

python - <<'EOF'
import os, torch, triton
try:
    import fla
    fla_version = fla.__version__
except Exception as err:  # noqa: BLE001 - report, do not fail: fla's tests skip without it
    fla_version = f"not importable ({type(err).__name__})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device: the gpu tests will skip"
print(f"gpu suite: {gpu}; torch {torch.__version__}, triton {triton.__version__}, fla {fla_version}; "
      f"{os.cpu_count()} CPUs; K3LAB_PIN_AUTOTUNE={os.environ.get('K3LAB_PIN_AUTOTUNE', '1 (default)')}")
print(f"fresh caches: TRITON_CACHE_DIR={os.environ['TRITON_CACHE_DIR']}, "
      f"TORCHINDUCTOR_CACHE_DIR={os.environ['TORCHINDUCTOR_CACHE_DIR']}")
EOF

limit="${GPU_SUITE_LIMIT_S:-500}"
start=$(date +%s.%N)
timeout -s INT --kill-after=30 "$limit" \
    python -m pytest -m "gpu or traced" -o addopts="" -q --durations=25 -p no:cacheprovider --junitxml="$report/gpu_suite.xml" \
    tests/ "$@" 2>&1 | tee "$report/gpu_suite.log"
status=${PIPESTATUS[0]}
end=$(date +%s.%N)
[ "$status" = 124 ] && echo "gpu suite: interrupted after GPU_SUITE_LIMIT_S=$limit s (the times below are of what ran)"

python - "$report/gpu_suite.xml" "$start" "$end" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

path, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
per_file, counts = defaultdict(float), defaultdict(int)
try:
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        name = case.get("classname", "?").split(".")
        module = next((part for part in name if part.startswith("test_")), name[-1])
        per_file[module] += float(case.get("time") or 0.0)
        counts[module] += 1
except (OSError, ET.ParseError) as err:
    print(f"(no per-file times: {err})")
if per_file:
    print("seconds per test file (setup + call + teardown of the tests that ran):")
    for module, seconds in sorted(per_file.items(), key=lambda item: -item[1]):
        print(f"{seconds:8.1f} s  {module} ({counts[module]} tests)")
    print(f"{sum(per_file.values()):8.1f} s  all {sum(counts.values())} tests (with -n: about one process's time, "
          "less what files share)")
wall = end - start
print(f"gpu suite wall time: {wall:.1f} s ({wall / 60:.1f} min; the target is under 300 s)")
EOF
exit "$status"
