# libs.sh: sourced by run.sh, torch_full.sh and one-off call scripts on the GPU
# machine: sets SP (Python's site-packages, where PyTorch's CUDA wheels live) and LD_LIBRARY_PATH.
# cuDNN trap (../shared/docs/gpu-machine.md): /usr/local/cuda/lib64 has cuDNN 9.14 as libcudnn.so;
# a private libcudnn.so link to PyTorch's 9.19 goes first.
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib
mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
