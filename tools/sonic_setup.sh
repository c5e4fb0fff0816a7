# SonicMoE (and Liger) on the GPU machine, from the carried .whl/ (docs: ../shared/GPU.md). Run from the repo root:
#   source tools/sonic_setup.sh      (exports what Python needs; `bash` it instead and it prints the exports)
# Installs once per machine into /tmp/site: the small wheels by pip, the CuTe-DSL libraries from their xz archive.
SONIC_SITE=/tmp/site
if [ ! -f "$SONIC_SITE/.sonic_ok" ]; then
  mkdir -p "$SONIC_SITE" &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SONIC_SITE" .whl/*.whl &&
  tar xJf .whl/nvidia_cutlass_dsl_libs_base-*.tar.xz -C "$SONIC_SITE" &&
  touch "$SONIC_SITE/.sonic_ok" || { echo "sonic_setup: install failed" >&2; return 1 2>/dev/null || exit 1; }
fi
# The libs wheel's .pth is not read from PYTHONPATH: its python_packages folder (the `cutlass` package) goes in by
# hand. Exported, not set in-process: QuACK's autotuner compiles in `python -m quack._compile_worker` subprocesses.
case ":$PYTHONPATH:" in *":$SONIC_SITE:"*) ;;  # sourced twice: once is enough
  *) export PYTHONPATH="$SONIC_SITE:$SONIC_SITE/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}" ;; esac
# Compiled kernels persist in the git-ignored .cache/ (kept on a warm machine between calls, or carried):
# CuTe-DSL's file cache (default /tmp/$USER/cutlass_python_cache), QuACK's .o per kernel (default
# /tmp/$USER/quack_cache), and QuACK's autotuning choice per shape (written only with QUACK_CACHE_AUTOTUNING=1).
export CUTE_DSL_CACHE_DIR="$PWD/.cache/cute_dsl" QUACK_CACHE_DIR="$PWD/.cache/quack" QUACK_CACHE_AUTOTUNING=1
# Parallel compile workers of QuACK's autotuner (default 8; the machine has 16 cores).
export QUACK_COMPILE_WORKERS="${QUACK_COMPILE_WORKERS:-12}"
mkdir -p "$CUTE_DSL_CACHE_DIR" "$QUACK_CACHE_DIR"
echo "export PYTHONPATH=$PYTHONPATH CUTE_DSL_CACHE_DIR=$CUTE_DSL_CACHE_DIR QUACK_CACHE_DIR=$QUACK_CACHE_DIR" \
  "QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=$QUACK_COMPILE_WORKERS"
