//! Timing of candidate kernels on the stream, for the timed choices between conv engines
//! (`KernelChoices::conv_log` prints each choice with its times).

use crate::device::Device;

/// Milliseconds that `f`'s work takes on the stream, between two events with timing enabled
/// (cudarc's `record_event(None)` creates them with timing disabled: every measurement would fail
/// and each timed choice fall to its first option).
pub(super) fn stream_ms(dev: &Device, f: impl FnOnce()) -> f32 {
    let ev =
        || dev.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("cuEventRecord");
    let e0 = ev();
    f();
    let e1 = ev();
    e1.synchronize().expect("cuEventSynchronize");
    e0.elapsed_ms(&e1).expect("cuEventElapsedTime")
}
