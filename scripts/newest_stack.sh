#!/usr/bin/env bash
# The suite on the newest releases, unpinned: what `pip install` gives a new user today.
#
#   scripts/newest_stack.sh [pytest arguments]
#
# Makes a fresh .venv-newest with Python 3.12, installs the newest torch that pip allows here first
# (so that nothing pulls another build after it), then hfjax with every extra and no constraints
# file, prints the versions it got, and runs the suite. Where it fails and the pinned stack
# (constraints.txt, .ci/run) passes, a new release changed something: look there first.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v python3.12 >/dev/null && python3.12 -c "" 2>/dev/null; then
  python=(python3.12)
else
  python=(env PYENV_VERSION=3.12.1 python3.12)  # pyenv's shim, where 3.12 is not the default
fi
rm -rf .venv-newest
"${python[@]}" -m venv .venv-newest
. .venv-newest/bin/activate
pip install -q --upgrade pip
pip install -q --upgrade torch
pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
python -c "
import importlib.metadata as m, sys
names = ('torch', 'jax', 'jaxlib', 'torchax', 'transformers', 'diffusers', 'peft', 'optax', 'safetensors', 'tokenizers')
print('newest stack: python', sys.version.split()[0], ' '.join(f'{n} {m.version(n)}' for n in names))
"
python -m pytest tests "$@"
