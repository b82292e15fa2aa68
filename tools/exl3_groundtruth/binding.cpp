// Python binding for the three exllamav3 reconstruction entry points this tool needs.
// The kernels themselves are compiled from exllamav3's own quant/reconstruct.cu (carried in
// .exl3src/, not part of this repository).
#include <torch/extension.h>
#include "quant/reconstruct.cuh"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("reconstruct", &reconstruct, "trellis -> W_hat [in, out] fp16");
    m.def("reconstruct_slice", &reconstruct_slice, "slice of reconstruct along out");
    m.def("reconstruct_had_slice", &reconstruct_had_slice, "fused suh . H . W_hat . H . svh");
}
