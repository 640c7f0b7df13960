//! 3-D convolution, `Backend::conv3d_*` and the fused conv primitives (torch.nn.Conv3d,
//! cross-correlation) for the cubic kernels k ∈ {1, 3}, stride 1 or 2 and padding (k−1)/2 that
//! Med-DDPM uses, in both layouts: NCDHW activations with (Cout, Cin, k, k, k) weights, or NDHWC
//! activations with (Cout, k, k, k, Cin) weights.
//!
//! Three engines compute a conv, and which one runs is decided per shape, direction and
//! accumulation (timed on first use where both apply, the choice kept in the on-disk cache):
//! cuDNN's legacy N-d API ([`cudnn`]), our few-channel direct kernels where cuDNN is slow
//! ([`small`], kernels/conv3d.cu) and our Hopper wgmma kernels for the wide 3×3×3 convs
//! ([`wgmma`], kernels/conv3d_wgmma.cu).
//!
//! The files, lowest first (each imports only the ones above it):
//! - [`timing`]: stream timing of a candidate, the choice log.
//! - [`desc`]: cuDNN descriptors, directions, algorithm ids, the per-shape plan.
//! - [`algo_cache`]: `ConvCache`, the per-backend state: plans, `cudnnFind`, the on-disk cache.
//! - [`cudnn`]: the cuDNN calls, operand conversion, the fused bias/residual epilogue.
//! - [`pad`]: the channel-padded forward (Cin or Cout not a multiple of 4).
//! - [`small`]: the few-channel kernels' launchers and the fused output head.
//! - [`wgmma`]: the wgmma kernels' launchers.
//! - [`choose`]: the timed choices between the engines.
//! - [`paths`]: the entry points `CudaBackend` calls (forward, backward, the fused GroupNorm+SiLU
//!   conv), each taking the path the choices give.
//! - [`upsample_conv`]: the Upsample's conv with the doubling fused into the wgmma kernels.
//! - [`parts`]: 1×1 convs over a concatenation's two parts (cuBLAS GEMMs).

mod algo_cache;
mod choose;
mod cudnn;
mod desc;
mod pad;
mod parts;
mod paths;
mod small;
mod timing;
mod upsample_conv;
pub(crate) mod wgmma;

pub(crate) use algo_cache::ConvCache;
pub(crate) use choose::{cat_free_chosen, gn_wgmma_chosen};
pub use desc::Algo;
pub(crate) use parts::{backward_data_1x1_into_parts, backward_filter_1x1_from_parts};
pub(crate) use paths::{backward, backward_data, backward_data_gn, forward, forward_res, gn_wgmma_forward};
pub(crate) use small::gn_head_forward;
pub(crate) use upsample_conv::{upsample_backward, upsample_forward};
