//! NVTX ranges for [`crate::CudaBackend`]'s `push_range`/`pop_range`: every U-Net block,
//! forward/backward and the profiler's `train`/`sample`/`optimizer` ranges become NVTX push/pop
//! ranges, so Nsight Compute can select one step (`ncu --nvtx --nvtx-include "profile/"`) and shows
//! the range stack of every profiled kernel.
//!
//! Why our own NVTX client: NVTX v3 is header-only — there is no `libnvToolsExt` to load in CUDA 13
//! (nor on the GPU machine), and the header's job is small: a tool (ncu, nsys) announces itself
//! through the environment variable `NVTX_INJECTION64_PATH`; the client `dlopen`s that library, calls
//! its `InitializeInjectionNvtx2(get_export_table)`, and the tool asks, through the export table,
//! for the client's function-pointer slots of each callback module and writes its handlers into
//! them. This file is that protocol (the NVTX v3 `nvtxImpl.h`/`nvtxInit.h` contract, module ids
//! and slot indices from `nvToolsExt.h`/`nvtxTypes.h`), for the two calls we make: `RangePushA`
//! and `RangePop` of the core module. Without a tool every call is a no-op costing one atomic load.
//! `MEDDPM_NVTX=0` turns the ranges off. Checked on the H200 with ncu 2025.3
//! (`scripts/gpu/nvtx_probe.sh`): `--nvtx-include profile/`, `train/` and `profile/train/` each
//! select the kernels of the recorded steps, whose full stack is e.g. `profile/train/forward/out`.

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::OnceLock;

/// Export-table ids (`NVTX_ETID_*`).
const ETID_CALLBACKS: u32 = 1;
const ETID_VERSIONINFO: u32 = 3;
/// NVTX API version this client implements (`NVTX_VERSION`).
const NVTX_VERSION: u32 = 3;
/// Slot counts of the callback modules, in module-id order 1.. (`NVTX_CBID_*_SIZE`): core, CUDA,
/// OpenCL, CUDA runtime, core2 (domains), sync.
const MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];
const SLOTS: usize = 16 + 9 + 15 + 7 + 16 + 7;
/// Core-module slot indices (`NVTX_CBID_CORE_RangePushA`, `NVTX_CBID_CORE_RangePop`).
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;

type PushFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PopFn = unsafe extern "C" fn() -> c_int;
type GetExportTable = unsafe extern "C" fn(u32) -> *const c_void;
type InitInjection = unsafe extern "C" fn(GetExportTable) -> c_int;

#[repr(C)]
struct ExportTableCallbacks {
    struct_size: usize,
    get_module_function_table: unsafe extern "C" fn(c_int, *mut *mut *mut *const c_void, *mut u32) -> c_int,
}

#[repr(C)]
struct ExportTableVersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(u32),
}

/// The client's function-pointer slots (what the tool writes its handlers into) and the table of
/// pointers to them that `GetModuleFunctionTable` hands out. Written only during the tool's
/// initialisation, which runs once under the [`OnceLock`] in [`state`].
struct Slots {
    fns: [*const c_void; SLOTS],
    ptrs: [*mut *const c_void; SLOTS],
}

static mut SLOTS_TABLE: Slots = Slots { fns: [std::ptr::null(); SLOTS], ptrs: [std::ptr::null_mut(); SLOTS] };

static CALLBACKS: ExportTableCallbacks =
    ExportTableCallbacks { struct_size: std::mem::size_of::<ExportTableCallbacks>(), get_module_function_table };
static VERSION_INFO: ExportTableVersionInfo = ExportTableVersionInfo {
    struct_size: std::mem::size_of::<ExportTableVersionInfo>(),
    version: NVTX_VERSION,
    reserved0: 0,
    set_injection_nvtx_version,
};

unsafe extern "C" fn set_injection_nvtx_version(_v: u32) {}

unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => &CALLBACKS as *const ExportTableCallbacks as *const c_void,
        ETID_VERSIONINFO => &VERSION_INFO as *const ExportTableVersionInfo as *const c_void,
        _ => std::ptr::null(),
    }
}

/// `GetModuleFunctionTable(module, &table, &size)`: module ids start at 1.
unsafe extern "C" fn get_module_function_table(
    module: c_int,
    out_table: *mut *mut *mut *const c_void,
    out_size: *mut u32,
) -> c_int {
    let m = module as i64 - 1;
    if m < 0 || m as usize >= MODULE_SIZES.len() {
        return 0;
    }
    let off: usize = MODULE_SIZES[..m as usize].iter().sum();
    // SAFETY: called by the tool from inside `InitializeInjectionNvtx2`, i.e. inside `state`'s
    // one-time initialisation, after `ptrs` was filled; nothing else touches the table then.
    unsafe {
        let t = &mut *std::ptr::addr_of_mut!(SLOTS_TABLE);
        if !out_table.is_null() {
            *out_table = t.ptrs.as_mut_ptr().add(off);
        }
        if !out_size.is_null() {
            *out_size = MODULE_SIZES[m as usize] as u32;
        }
    }
    1
}

/// The handlers a tool installed.
struct Tool {
    push: PushFn,
    pop: PopFn,
    /// Keeps the tool library loaded.
    _lib: Option<libloading::Library>,
}

/// Run the injection handshake with `init` (a tool's `InitializeInjectionNvtx2`) and read back
/// the range handlers it installed.
///
/// # Safety
/// `init` must follow the NVTX injection contract; call at most once per process.
unsafe fn attach(init: InitInjection, lib: Option<libloading::Library>) -> Result<Tool, String> {
    // SAFETY: single-threaded one-time initialisation (see `state`).
    let t = unsafe { &mut *std::ptr::addr_of_mut!(SLOTS_TABLE) };
    for i in 0..SLOTS {
        t.fns[i] = std::ptr::null();
        t.ptrs[i] = std::ptr::addr_of_mut!(t.fns[i]);
    }
    // SAFETY: the caller vouches for `init`.
    let ok = unsafe { init(get_export_table) };
    if ok != 1 {
        return Err(format!("the tool's InitializeInjectionNvtx2 returned {ok}"));
    }
    let (push, pop) = (t.fns[CORE_RANGE_PUSH_A], t.fns[CORE_RANGE_POP]);
    if push.is_null() || pop.is_null() {
        return Err("the tool installed no RangePushA/RangePop handlers".into());
    }
    // SAFETY: the tool wrote function pointers of the NVTX signatures into these slots.
    unsafe {
        Ok(Tool {
            push: std::mem::transmute::<*const c_void, PushFn>(push),
            pop: std::mem::transmute::<*const c_void, PopFn>(pop),
            _lib: lib,
        })
    }
}

/// Load the tool named by `NVTX_INJECTION64_PATH` (set by ncu/nsys), if any.
fn load_tool() -> Result<Option<Tool>, String> {
    let Some(path) = std::env::var_os("NVTX_INJECTION64_PATH") else { return Ok(None) };
    // SAFETY: loading the profiler's own injection library, as the NVTX header does.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("cannot load the NVTX tool {}: {e}", path.to_string_lossy()))?;
    // SAFETY: the symbol has the NVTX injection signature by contract.
    let init: InitInjection = unsafe {
        *lib.get::<InitInjection>(b"InitializeInjectionNvtx2\0")
            .map_err(|e| format!("{} has no InitializeInjectionNvtx2: {e}", path.to_string_lossy()))?
    };
    // SAFETY: called once, from `state`'s initialisation.
    unsafe { attach(init, Some(lib)) }.map(Some)
}

/// `Err(why)` when ranges are off; `Ok(None)` when on but no tool listens; `Ok(Some)` with a tool.
fn state() -> &'static Result<Option<Tool>, String> {
    static S: OnceLock<Result<Option<Tool>, String>> = OnceLock::new();
    S.get_or_init(|| {
        if std::env::var("MEDDPM_NVTX").map(|v| v == "0").unwrap_or(false) {
            return Err("turned off by MEDDPM_NVTX=0".into());
        }
        let r = load_tool();
        if let Err(e) = &r {
            eprintln!("warning: NVTX ranges off: {e}");
        }
        r
    })
}

/// `Ok` when this process emits NVTX ranges to a tool that asks for them (ncu/nsys set
/// `NVTX_INJECTION64_PATH` in the processes they profile), else why not.
pub(crate) fn status() -> Result<(), String> {
    state().as_ref().map(|_| ()).map_err(|e| e.clone())
}

/// Whether a tool is attached to this process right now.
pub(crate) fn tool_attached() -> bool {
    matches!(state(), Ok(Some(_)))
}

/// Open a push/pop range (no-op without a tool). NUL bytes in the name are dropped.
pub(crate) fn push(name: &str) {
    if let Ok(Some(t)) = state() {
        let c = CString::new(name.replace('\0', "")).unwrap_or_default();
        // SAFETY: the tool's handler takes a NUL-terminated string valid for the call.
        unsafe { (t.push)(c.as_ptr()) };
    }
}

/// Close the innermost range (no-op without a tool).
pub(crate) fn pop() {
    if let Ok(Some(t)) = state() {
        // SAFETY: the tool's handler takes no arguments.
        unsafe { (t.pop)() };
    }
}

#[cfg(test)]
mod tests {
    //! A fake tool plays ncu's side of the handshake: it asks for the export tables, checks the
    //! version info, fills the core module's RangePushA/RangePop slots and the core2 module's
    //! last slot, and records the calls it receives.
    use super::*;
    use std::sync::Mutex;

    static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

    unsafe extern "C" fn fake_push(s: *const c_char) -> c_int {
        let name = unsafe { std::ffi::CStr::from_ptr(s) }.to_string_lossy().into_owned();
        LOG.lock().unwrap().push(format!("push {name}"));
        0
    }
    unsafe extern "C" fn fake_pop() -> c_int {
        LOG.lock().unwrap().push("pop".into());
        0
    }

    unsafe extern "C" fn fake_init(get: GetExportTable) -> c_int {
        unsafe {
            let v = get(ETID_VERSIONINFO) as *const ExportTableVersionInfo;
            assert!(!v.is_null() && (*v).version == 3 && (*v).struct_size >= 16);
            assert!(get(99).is_null(), "unknown export table ids give null");
            let cb = get(ETID_CALLBACKS) as *const ExportTableCallbacks;
            let mut table: *mut *mut *const c_void = std::ptr::null_mut();
            let mut size = 0u32;
            assert_eq!(((*cb).get_module_function_table)(0, &mut table, &mut size), 0, "module 0 is invalid");
            assert_eq!(((*cb).get_module_function_table)(7, &mut table, &mut size), 0, "module 7 is invalid");
            assert_eq!(((*cb).get_module_function_table)(1, &mut table, &mut size), 1);
            assert_eq!(size, 16);
            *(*table.add(9)) = fake_push as *const c_void;
            *(*table.add(11)) = fake_pop as *const c_void;
            // core2 (module 5): writing its last slot must stay inside our table
            assert_eq!(((*cb).get_module_function_table)(5, &mut table, &mut size), 1);
            assert_eq!(size, 16);
            *(*table.add(15)) = fake_pop as *const c_void;
        }
        1
    }

    unsafe extern "C" fn refusing_init(_get: GetExportTable) -> c_int {
        0
    }

    /// One test: `attach` rewrites the process-wide slot table, so the cases run in sequence.
    #[test]
    fn handshake_installs_the_tool_handlers() {
        assert!(unsafe { attach(refusing_init, None) }.is_err(), "a tool that refuses is an error");
        let tool = unsafe { attach(fake_init, None) }.expect("attach");
        let c = CString::new("train").unwrap();
        unsafe {
            (tool.push)(c.as_ptr());
            (tool.pop)();
        }
        assert_eq!(*LOG.lock().unwrap(), vec!["push train".to_string(), "pop".to_string()]);
        // the core2 slot the fake wrote sits at offset 16 + 9 + 15 + 7 + 15
        let t = unsafe { &*std::ptr::addr_of!(SLOTS_TABLE) };
        assert_eq!(t.fns[16 + 9 + 15 + 7 + 15], fake_pop as *const c_void);
        assert!(t.fns[CORE_RANGE_PUSH_A + 1].is_null());
    }
}
