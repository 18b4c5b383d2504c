# Source from the repo root on the GPU machine: makes `import reap_swap.*` resolve to this checkout
# (the repo root is the package; pyproject maps its folders onto subpackages) without installing it.
# Run Python from outside the repo root afterwards, or the root's reap_swap/ folder shadows the shim.
R=${R:-$PWD}
# Rebuilt only when the checkout or the names in its reap_swap/ change (a stamp records both): a second source
# (a session script sourcing it while another job imports from the shim) must not delete it under that job,
# which then fails with "No module named 'reap_swap'".
# REAP_SHIM_DIR (default /tmp/shim) moves it, e.g. for the test of this script.
_shim_dir=${REAP_SHIM_DIR:-/tmp/shim}
_stamp="$R $(ls $R/reap_swap | tr '\n' ' ')"
if [ "$(cat $_shim_dir/.stamp 2>/dev/null)" != "$_stamp" ]; then
  _new=$(mktemp -d $_shim_dir.XXXXXX) || return 1
  chmod 755 $_new && mkdir -p $_new/reap_swap
  for f in $R/reap_swap/*; do ln -s "$f" $_new/reap_swap/; done
  for p in server_ext planning models proxy classifier example benchmarks; do ln -s $R/$p $_new/reap_swap/$p; done
  echo "$_stamp" > $_new/.stamp
  rm -rf $_shim_dir && mv $_new $_shim_dir
fi
export PYTHONPATH=$_shim_dir:${PYTHONPATH:-}
unset _stamp _new _shim_dir
# The CLI from /tmp (outside the repo root, so the shim's reap_swap is the one imported): `rs bench-gpu ...`
rs() { (cd /tmp && python3 -c "import sys; from reap_swap.cli import main; sys.exit(main())" "$@"); }
# vLLM staged by an earlier call on this machine: its exports do not carry across device calls, so take
# them again here (setup_on_device.sh skips the unpacking it already did).
if [ -f /tmp/site/.deps_done ] && [ -f /tmp/stage/setup_on_device.sh ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) source /tmp/stage/setup_on_device.sh > /dev/null ;; esac
fi
