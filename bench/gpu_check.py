"""One GPU session's worth of checks: every kernel test at full size and the GPU engine tests,
the kernel benchmarks, then the model checks against HF transformers.

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT

Writes OUT/gpu_check_h200.txt (environment and pytest output), OUT/kernels_h200.json
(bench/kernels.py) and OUT/gpu_model_check_h200.json (bench/gpu_model_check.py). Packages the GPU image lacks travel as wheels in .whl/ and are installed
into /tmp/site first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_wheels(wheels: Path, env: dict[str, str]) -> str:
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        return "no wheels to install"
    target = "/tmp/site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*cmd, "--no-cache-dir", "--upgrade", "--target", target, *found], check=True)
    env["PYTHONPATH"] = os.pathsep.join([target, env.get("PYTHONPATH", "")])
    return "installed " + " ".join(Path(w).name for w in found)


def run(cmd: list[str], env: dict[str, str], log: list[str], timeout: int) -> int:
    log.append(f"$ {' '.join(cmd)}")
    start = time.time()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMED OUT after {timeout} s", 124
    log.append(output.rstrip())
    log.append(f"(exit {code}, {time.time() - start:.0f} s)")
    print(log[-2][-6000:], log[-1], sep="\n", flush=True)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    parser.add_argument("--test-timeout", type=int, default=300)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    log = [f"gpu_check {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", install_wheels(args.wheels, env)]
    version = "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
    run([sys.executable, "-c", version], env, log, 120)
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernels_*.py"))
    tests.append("tests/test_gpu_engine.py")
    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-n",
        "8",
        *tests,
    ]
    test_code = run(pytest, env, log, args.test_timeout)
    (args.out / "gpu_check_h200.txt").write_text("\n".join(log) + "\n")
    bench = [
        sys.executable,
        str(ROOT / "bench" / "kernels.py"),
        "--out",
        str(args.out / "kernels_h200.json"),
    ]
    bench_code = run(bench, env, log, 400)
    (args.out / "gpu_check_h200.txt").write_text("\n".join(log) + "\n")
    models = [
        sys.executable,
        str(ROOT / "bench" / "gpu_model_check.py"),
        "--out",
        str(args.out / "gpu_model_check_h200.json"),
    ]
    model_code = run(models, env, log, 300)
    (args.out / "gpu_check_h200.txt").write_text("\n".join(log) + "\n")
    print(f"tests exit {test_code}, bench exit {bench_code}, model checks exit {model_code}")


if __name__ == "__main__":
    main()
