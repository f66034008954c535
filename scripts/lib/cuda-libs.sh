# Shared by the GPU scripts (sourced, not run): puts the CUDA libraries cudarc loads at run time
# on LD_LIBRARY_PATH: the system's (/usr/local/cuda), else those of PyTorch's pip packages
# (nvidia-*), found through the Python in $PY (default python3).
cuda_libdirs=$("${PY:-python3}" - <<'PYEOF' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages():
    for pat in ("nvidia/*/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
        for d in glob.glob(os.path.join(base, pat)):
            if glob.glob(os.path.join(d, "libnvrtc.so*")) or glob.glob(os.path.join(d, "libcublas.so*")):
                dirs.add(d)
print(":".join(sorted(dirs)))
PYEOF
)
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64:${cuda_libdirs}"
