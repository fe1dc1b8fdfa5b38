# Sourced by scripts/up.sh and scripts/test.sh: ensure_venv EXTRAS makes .venv and
# installs the project with EXTRAS (e.g. server, dev) into it, and skips pip when nothing
# it depends on changed since the last install (pyproject.toml, setup.py, the extras, the
# Python): a restart then takes seconds, not the minutes a reinstall does. The editable
# install follows source edits by itself. DXPOOL_REINSTALL=1 forces the install.
ensure_venv() {
  local extras="$1"
  local python="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  local stamp=".venv/.dxpool-installed-${extras//,/-}"
  local wanted
  wanted="$( { cat pyproject.toml setup.py; echo "extras=$extras"; .venv/bin/python -VV; } \
    | sha256sum | cut -d' ' -f1)"
  if [ -z "${DXPOOL_REINSTALL:-}" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] \
    && .venv/bin/python -c "import dxpool.cli.main" 2>/dev/null; then
    return 0
  fi
  echo "installing dxpool[$extras] into .venv (once; again only when pyproject.toml changes)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  echo "$wanted" > "$stamp"
}
