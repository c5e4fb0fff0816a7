# The benchmark's peers (SonicMoE, Liger, TorchAO) and the integrations' torchtitan (with spmd_types) on the GPU
# machine, from the carried, git-ignored .whl/. Run from the repo root: `source tools/gpu_env.sh` (exports what Python
# needs; tools/gpu_run.sh sources it). Installs once per machine into /tmp/site: the wheels by pip, CuTe-DSL's
# libraries from their xz archive when it was carried.
SITE=/tmp/site
if [ ! -f "$SITE/.gpu_env_ok" ]; then
  mkdir -p "$SITE" &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl &&
  { ! compgen -G ".whl/*.tar.xz" >/dev/null || tar xJf .whl/nvidia_cutlass_dsl_libs_base-*.tar.xz -C "$SITE"; } &&
  touch "$SITE/.gpu_env_ok" || { echo "gpu_env: install failed" >&2; return 1 2>/dev/null || exit 1; }
fi
# The libs wheel's .pth is not read from PYTHONPATH: its python_packages folder (the `cutlass` package) goes in by
# hand. Exported, not set in-process: QuACK's autotuner compiles in `python -m quack._compile_worker` subprocesses.
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;;  # sourced twice: once is enough
  *) export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}" ;; esac
# Compiled kernels persist in the git-ignored .cache/ (kept on a warm machine between calls, or carried):
# CuTe-DSL's file cache (default /tmp/$USER/cutlass_python_cache), QuACK's .o per kernel (default
# /tmp/$USER/quack_cache), and QuACK's autotuning choice per shape (written only with QUACK_CACHE_AUTOTUNING=1).
export CUTE_DSL_CACHE_DIR="$PWD/.cache/cute_dsl" QUACK_CACHE_DIR="$PWD/.cache/quack" QUACK_CACHE_AUTOTUNING=1
# Parallel compile workers of QuACK's autotuner (default 8; the machine has 16 cores).
export QUACK_COMPILE_WORKERS="${QUACK_COMPILE_WORKERS:-12}"
mkdir -p "$CUTE_DSL_CACHE_DIR" "$QUACK_CACHE_DIR"
echo "export PYTHONPATH=$PYTHONPATH CUTE_DSL_CACHE_DIR=$CUTE_DSL_CACHE_DIR QUACK_CACHE_DIR=$QUACK_CACHE_DIR" \
  "QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=$QUACK_COMPILE_WORKERS"
