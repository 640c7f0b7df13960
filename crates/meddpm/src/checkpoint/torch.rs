//! PyTorch `.pt` checkpoints without Python: a reader of `torch.save`'s zip format, the mapping of
//! a Med-DDPM state dict onto our U-Net parameters, config inference from tensor shapes, and an
//! exporter to safetensors with PyTorch's own key names.
//!
//! Format (spec §4.1, PyTorch `torch/serialization.py`): a zip archive `<stem>/data.pkl` (a pickle,
//! protocol 2, of the saved object), `<stem>/data/<key>` (raw storages), `<stem>/byteorder`,
//! `<stem>/version`. Tensors appear in the pickle as `torch._utils._rebuild_tensor_v2(storage,
//! offset, size, stride, requires_grad, hooks)` whose storage is a persistent id
//! `('storage', torch.FloatStorage, key, location, numel)`; dicts are `collections.OrderedDict`.
//! Med-DDPM's trainer saves `{'step', 'model', 'ema'}` (two GaussianDiffusion state dicts: 13
//! schedule buffers plus the U-Net under `denoise_fn.`); its fast-sampling net is a bare state dict.
//!
//! No maintained Rust crate reads this subset well (`serde-pickle` has no persistent ids and
//! cannot evaluate torch's REDUCE calls), so this file holds a small unpickler of the opcodes a
//! pickle of protocol ≤ 5 can contain. It builds plain values and recognises exactly these
//! callables: `collections.OrderedDict`, `torch._utils._rebuild_tensor(_v2)` and
//! `torch._utils._rebuild_parameter(_with_state)`; any other callable becomes an opaque object,
//! which is an error only where a tensor is needed. Nothing is executed.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::checkpoint::native::{serialize, write_atomic};
use crate::diffusion::schedule::Schedule;
use crate::error::{Error, Result};
use crate::model::config::UNetConfig;
use crate::model::params::param_specs;

/// One state dict: (key, PyTorch shape, values converted to f32 in row-major order), file order.
pub type StateDict = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Everything `torch.save` put in the file that is a state dict.
#[derive(Clone, Debug)]
pub struct TorchCheckpoint {
    /// The file it came from (for messages).
    pub path: PathBuf,
    /// The top-level `'step'` entry, if any.
    pub step: Option<i64>,
    /// State dicts by top-level key (`"model"`, `"ema"`, ...), or `""` for a bare state dict.
    pub dicts: BTreeMap<String, StateDict>,
    /// The distinct storage location tags read (`"cpu"`, `"cuda:0"`, ...): informational only,
    /// every tensor is read to host memory.
    pub storage_locations: Vec<String>,
}

/// The prefix Med-DDPM's GaussianDiffusion puts before every U-Net key.
pub const DENOISE_PREFIX: &str = "denoise_fn.";

/// The 13 GaussianDiffusion buffers (spec §3.1), in registration order.
pub use crate::diffusion::schedule::BUFFER_NAMES as SCHEDULE_BUFFERS;

impl TorchCheckpoint {
    /// The dict named `which` (`"ema"`, `"model"`, `""` for bare); `None` picks `ema`, then
    /// `model`, then the bare dict, then the only dict there is.
    pub fn dict(&self, which: Option<&str>) -> Result<(&str, &StateDict)> {
        let names: Vec<&str> = self.dicts.keys().map(|k| k.as_str()).collect();
        let pick = match which {
            Some(w) => self.dicts.get_key_value(w),
            None => ["ema", "model", ""].iter().find_map(|w| self.dicts.get_key_value(*w)).or_else(|| {
                if self.dicts.len() == 1 {
                    self.dicts.iter().next()
                } else {
                    None
                }
            }),
        };
        pick.map(|(k, v)| (k.as_str(), v)).ok_or_else(|| {
            Error::format(
                &self.path,
                format!(
                    "no state dict {} in this checkpoint; it has {:?} (\"\" = a bare state dict)",
                    which.map(|w| format!("{w:?}")).unwrap_or_else(|| "'ema', 'model' or bare".into()),
                    names
                ),
            )
        })
    }

    /// [`map_to_unet`] on the dict `which` (see [`TorchCheckpoint::dict`]); errors name the file.
    pub fn to_unet(&self, which: Option<&str>, cfg: &UNetConfig) -> Result<MappedUNet> {
        let (name, d) = self.dict(which)?;
        map_to_unet(d, cfg).map_err(|e| match e {
            Error::Checkpoint { msg, .. } => {
                Error::Checkpoint { path: self.path.clone(), msg: format!("dict {name:?}: {msg}") }
            }
            e => e,
        })
    }
}

// ------------------------------------------------------------------------------------------------
// Pickle values
// ------------------------------------------------------------------------------------------------

/// Element types of torch storages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    fn from_storage_class(name: &str) -> Option<DType> {
        Some(match name {
            "FloatStorage" => DType::F32,
            "DoubleStorage" => DType::F64,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" | "UntypedStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        })
    }
    fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
    /// One element from its bytes, already in little-endian order.
    fn to_f32(self, b: &[u8]) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            DType::F64 => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
            DType::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            DType::BF16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
            DType::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
            DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32,
            DType::I16 => i16::from_le_bytes([b[0], b[1]]) as f32,
            DType::I8 => b[0] as i8 as f32,
            DType::U8 => b[0] as f32,
            DType::Bool => (b[0] != 0) as u8 as f32,
        }
    }
}

/// IEEE binary16 → binary32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: m·2^-24, normalise
            let shift = m.leading_zeros() - 21; // bring the top bit to position 10
            let m = (m << shift) & 0x3ff;
            let e = 127 - 15 + 1 - shift;
            sign | (e << 23) | (m << 13)
        }
        (31, 0) => sign | 0x7f80_0000,
        (31, m) => sign | 0x7f80_0000 | (m << 13) | 0x0040_0000,
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[derive(Debug)]
struct StorageRef {
    dtype: DType,
    key: String,
    location: String,
    numel: usize,
}

#[derive(Debug)]
struct TensorRef {
    storage: Rc<StorageRef>,
    offset: usize,
    size: Vec<usize>,
    stride: Vec<usize>,
}

#[derive(Debug)]
struct Obj {
    class: String,
}

/// A pickle value. Floats and bytes are parsed faithfully though no state dict needs them.
#[derive(Clone, Debug)]
#[allow(dead_code)]
enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Rc<Vec<Val>>),
    List(Rc<RefCell<Vec<Val>>>),
    Dict(Rc<RefCell<Vec<(Val, Val)>>>),
    Global(Rc<(String, String)>),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
    Object(Rc<Obj>),
}

impl Val {
    fn kind(&self) -> String {
        match self {
            Val::None => "None".into(),
            Val::Bool(_) => "bool".into(),
            Val::Int(_) => "int".into(),
            Val::Float(_) => "float".into(),
            Val::Str(_) => "str".into(),
            Val::Bytes(_) => "bytes".into(),
            Val::Tuple(_) => "tuple".into(),
            Val::List(_) => "list".into(),
            Val::Dict(_) => "dict".into(),
            Val::Global(g) => format!("global {}.{}", g.0, g.1),
            Val::Storage(_) => "storage".into(),
            Val::Tensor(_) => "tensor".into(),
            Val::Object(o) => format!("{} object", o.class),
        }
    }
    fn as_usize(&self) -> Option<usize> {
        match self {
            Val::Int(i) if *i >= 0 => Some(*i as usize),
            Val::Bool(b) => Some(*b as usize),
            _ => None,
        }
    }
    fn as_usize_tuple(&self) -> Option<Vec<usize>> {
        match self {
            Val::Tuple(t) => t.iter().map(|v| v.as_usize()).collect(),
            Val::List(l) => l.borrow().iter().map(|v| v.as_usize()).collect(),
            _ => None,
        }
    }
    fn same_key(&self, other: &Val) -> bool {
        match (self, other) {
            (Val::Str(a), Val::Str(b)) => a == b,
            (Val::Int(a), Val::Int(b)) => a == b,
            _ => false,
        }
    }
}

fn dict_set(d: &mut Vec<(Val, Val)>, k: Val, v: Val) {
    match d.iter_mut().find(|(key, _)| key.same_key(&k)) {
        Some(slot) => slot.1 = v,
        None => d.push((k, v)),
    }
}

// ------------------------------------------------------------------------------------------------
// The unpickler
// ------------------------------------------------------------------------------------------------

struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed (for messages).
    op_pos: usize,
    stack: Vec<Val>,
    marks: Vec<usize>,
    memo: HashMap<u32, Val>,
    path: &'a Path,
}

impl<'a> Unpickler<'a> {
    fn new(data: &'a [u8], path: &'a Path) -> Self {
        Unpickler { data, pos: 0, op_pos: 0, stack: Vec::new(), marks: Vec::new(), memo: HashMap::new(), path }
    }

    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::format(self.path, format!("data.pkl byte {}: {msg}", self.op_pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.data.len() - self.pos < n {
            return Err(
                self.err(format!("pickle ends early (needs {n} more bytes, {} left)", self.data.len() - self.pos))
            );
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn len_u64(&mut self) -> Result<usize> {
        let n = self.u64()?;
        usize::try_from(n).map_err(|_| self.err(format!("length {n} too large")))
    }
    fn line(&mut self) -> Result<&'a str> {
        let rest = &self.data[self.pos..];
        let n = rest.iter().position(|&c| c == b'\n').ok_or_else(|| self.err("unterminated text line"))?;
        self.pos += n + 1;
        std::str::from_utf8(&rest[..n]).map_err(|_| self.err("text line is not UTF-8"))
    }
    fn utf8(&self, b: &[u8]) -> Result<String> {
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not valid UTF-8"))
    }

    fn pop(&mut self) -> Result<Val> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("stack underflow (corrupt pickle)"));
        }
        Ok(self.stack.pop().expect("checked non-empty"))
    }
    fn top(&mut self) -> Result<&mut Val> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("stack underflow (corrupt pickle)"));
        }
        Ok(self.stack.last_mut().expect("checked non-empty"))
    }
    fn pop_mark(&mut self) -> Result<Vec<Val>> {
        let m = self.marks.pop().ok_or_else(|| self.err("no MARK on the stack (corrupt pickle)"))?;
        Ok(self.stack.split_off(m))
    }
    fn memo_get(&self, i: u32) -> Result<Val> {
        self.memo.get(&i).cloned().ok_or_else(|| self.err(format!("memo entry {i} was never stored")))
    }
    fn memo_put(&mut self, i: u32) -> Result<()> {
        let v = self.stack.last().cloned().ok_or_else(|| self.err("PUT on an empty stack"))?;
        self.memo.insert(i, v);
        Ok(())
    }

    fn run(mut self) -> Result<Val> {
        loop {
            self.op_pos = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(self.err(format!("pickle protocol {p} is newer than 5")));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: a size hint
                }
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                b'N' => self.stack.push(Val::None),
                0x88 => self.stack.push(Val::Bool(true)),
                0x89 => self.stack.push(Val::Bool(false)),
                b'J' => {
                    let v = self.u32()? as i32;
                    self.stack.push(Val::Int(v as i64));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Val::Int(v as i64));
                }
                b'M' => {
                    let v = self.u16()?;
                    self.stack.push(Val::Int(v as i64));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a { self.u8()? as usize } else { self.u32()? as usize };
                    let b = self.take(n)?;
                    if n > 8 {
                        return Err(self.err(format!("integer of {n} bytes does not fit in 64 bits")));
                    }
                    let mut v: i64 = 0;
                    for (i, &byte) in b.iter().enumerate() {
                        v |= (byte as i64) << (8 * i);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n); // sign-extend
                    }
                    self.stack.push(Val::Int(v));
                }
                b'I' | b'L' => {
                    let s = self.line()?.trim_end_matches('L');
                    let v = match s {
                        "00" => Val::Bool(false),
                        "01" => Val::Bool(true),
                        s => Val::Int(s.parse().map_err(|_| self.err(format!("bad integer literal {s:?}")))?),
                    };
                    self.stack.push(v);
                }
                b'G' => {
                    let b = self.take(8)?;
                    self.stack.push(Val::Float(f64::from_be_bytes(b.try_into().expect("8 bytes"))));
                }
                b'F' => {
                    let s = self.line()?;
                    let v = s.parse().map_err(|_| self.err(format!("bad float literal {s:?}")))?;
                    self.stack.push(Val::Float(v));
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => self.u32()? as usize,
                        0x8c => self.u8()? as usize,
                        _ => self.len_u64()?,
                    };
                    let b = self.take(n)?;
                    let s = self.utf8(b)?;
                    self.stack.push(Val::Str(s));
                }
                b'T' | b'U' => {
                    // BINSTRING / SHORT_BINSTRING: Python 2 str, bytes taken as Latin-1 text
                    let n = if op == b'T' { self.u32()? as usize } else { self.u8()? as usize };
                    let b = self.take(n)?;
                    self.stack.push(Val::Str(b.iter().map(|&c| c as char).collect()));
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => self.u32()? as usize,
                        b'C' => self.u8()? as usize,
                        _ => self.len_u64()?,
                    };
                    let b = self.take(n)?;
                    self.stack.push(Val::Bytes(b.to_vec()));
                }
                b')' => self.stack.push(Val::Tuple(Rc::new(Vec::new()))),
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Val::Tuple(Rc::new(items)));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.stack.push(Val::Tuple(Rc::new(items)));
                }
                b']' => self.stack.push(Val::List(Rc::new(RefCell::new(Vec::new())))),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Val::List(Rc::new(RefCell::new(items))));
                }
                b'a' => {
                    let v = self.pop()?;
                    match self.top()? {
                        Val::List(l) => l.borrow_mut().push(v),
                        other => {
                            let k = other.kind();
                            return Err(self.err(format!("APPEND to a {k}")));
                        }
                    }
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    match self.top()? {
                        Val::List(l) => l.borrow_mut().extend(items),
                        other => {
                            let k = other.kind();
                            return Err(self.err(format!("APPENDS to a {k}")));
                        }
                    }
                }
                b'}' => self.stack.push(Val::Dict(Rc::new(RefCell::new(Vec::new())))),
                b'd' => {
                    let items = self.pop_mark()?;
                    let d = self.pairs_to_dict(items)?;
                    self.stack.push(d);
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                0x8f => self.stack.push(Val::List(Rc::new(RefCell::new(Vec::new())))), // EMPTY_SET
                0x90 => {
                    let items = self.pop_mark()?;
                    match self.top()? {
                        Val::List(l) => l.borrow_mut().extend(items),
                        other => {
                            let k = other.kind();
                            return Err(self.err(format!("ADDITEMS to a {k}")));
                        }
                    }
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(Val::List(Rc::new(RefCell::new(items))));
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.stack.push(Val::Global(Rc::new((module, name))));
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Val::Str(m), Val::Str(n)) => self.stack.push(Val::Global(Rc::new((m, n)))),
                        (m, n) => return Err(self.err(format!("STACK_GLOBAL of {} and {}", m.kind(), n.kind()))),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.call(&func, &args)?;
                    self.stack.push(v);
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(&cls, &args)?;
                    self.stack.push(v);
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(&cls, &args)?;
                    self.stack.push(v);
                }
                b'b' => {
                    // BUILD: set state. State dicts carry `_metadata` this way; tensors and
                    // opaque objects need nothing from it.
                    let _state = self.pop()?;
                    self.top()?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent(&pid)?;
                    self.stack.push(v);
                }
                b'P' => {
                    let s = self.line()?.to_string();
                    return Err(self.err(format!("text persistent id {s:?} (not a torch storage)")));
                }
                b'q' => {
                    let i = self.u8()? as u32;
                    self.memo_put(i)?;
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(i)?;
                }
                b'p' => {
                    let s = self.line()?;
                    let i = s.parse().map_err(|_| self.err(format!("bad PUT index {s:?}")))?;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = self.memo.len() as u32;
                    self.memo_put(i)?;
                }
                b'h' => {
                    let i = self.u8()? as u32;
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                b'j' => {
                    let i = self.u32()?;
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                b'g' => {
                    let s = self.line()?;
                    let i = s.parse().map_err(|_| self.err(format!("bad GET index {s:?}")))?;
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                op => {
                    return Err(self.err(format!(
                        "unsupported pickle opcode 0x{op:02x} ({:?}): not a PyTorch state-dict pickle, or corrupt",
                        op as char
                    )))
                }
            }
        }
    }

    fn pairs_to_dict(&self, items: Vec<Val>) -> Result<Val> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for a dict"));
        }
        let mut d = Vec::with_capacity(items.len() / 2);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            dict_set(&mut d, k, v);
        }
        Ok(Val::Dict(Rc::new(RefCell::new(d))))
    }

    fn set_items(&mut self, items: Vec<Val>) -> Result<()> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for SETITEMS"));
        }
        let d = match self.top()? {
            Val::Dict(d) => d.clone(),
            other => {
                let k = other.kind();
                return Err(self.err(format!("SETITEM(S) on a {k}")));
            }
        };
        let mut d = d.borrow_mut();
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            dict_set(&mut d, k, v);
        }
        Ok(())
    }

    /// `('storage', torch.<T>Storage, key, location, numel)`.
    fn persistent(&self, pid: &Val) -> Result<Val> {
        let bad = || {
            self.err(format!(
                "unsupported persistent id (a {}), expected ('storage', type, key, location, numel)",
                pid.kind()
            ))
        };
        let t = match pid {
            Val::Tuple(t) if t.len() == 5 => t,
            _ => return Err(bad()),
        };
        match &t[0] {
            Val::Str(s) if s == "storage" => {}
            _ => return Err(bad()),
        }
        let dtype = match &t[1] {
            Val::Global(g) => DType::from_storage_class(&g.1)
                .ok_or_else(|| self.err(format!("unsupported storage type {}.{}", g.0, g.1)))?,
            _ => return Err(bad()),
        };
        let key = match &t[2] {
            Val::Str(s) => s.clone(),
            Val::Int(i) => i.to_string(),
            _ => return Err(bad()),
        };
        let location = match &t[3] {
            Val::Str(s) => s.clone(),
            _ => return Err(bad()),
        };
        let numel = t[4].as_usize().ok_or_else(bad)?;
        Ok(Val::Storage(Rc::new(StorageRef { dtype, key, location, numel })))
    }

    fn call(&self, func: &Val, args: &Val) -> Result<Val> {
        let (module, name) = match func {
            Val::Global(g) => (g.0.as_str(), g.1.as_str()),
            other => return Ok(Val::Object(Rc::new(Obj { class: format!("<{}>", other.kind()) }))),
        };
        let args: &[Val] = match args {
            Val::Tuple(t) => t,
            other => return Err(self.err(format!("{module}.{name} called with a {} instead of a tuple", other.kind()))),
        };
        match (module, name) {
            ("collections", "OrderedDict") | ("builtins", "dict") | ("__builtin__", "dict") => {
                let mut d = Vec::new();
                if let Some(Val::List(l)) = args.first() {
                    for item in l.borrow().iter() {
                        if let Val::Tuple(kv) = item {
                            if kv.len() == 2 {
                                dict_set(&mut d, kv[0].clone(), kv[1].clone());
                            }
                        }
                    }
                }
                Ok(Val::Dict(Rc::new(RefCell::new(d))))
            }
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
                if args.len() < 4 {
                    return Err(self.err(format!("{name} with {} arguments, expected at least 4", args.len())));
                }
                let storage = match &args[0] {
                    Val::Storage(s) => s.clone(),
                    other => {
                        return Err(self.err(format!("{name}: first argument is a {}, not a storage", other.kind())))
                    }
                };
                let offset = args[1].as_usize().ok_or_else(|| self.err(format!("{name}: bad storage offset")))?;
                let size = args[2].as_usize_tuple().ok_or_else(|| self.err(format!("{name}: bad size")))?;
                let stride = args[3].as_usize_tuple().ok_or_else(|| self.err(format!("{name}: bad stride")))?;
                if size.len() != stride.len() {
                    return Err(self.err(format!("{name}: size {size:?} and stride {stride:?} differ in rank")));
                }
                // every element must lie inside the storage
                let mut last = offset;
                let mut empty = false;
                for (&n, &s) in size.iter().zip(&stride) {
                    if n == 0 {
                        empty = true;
                    } else {
                        last = (n - 1)
                            .checked_mul(s)
                            .and_then(|x| x.checked_add(last))
                            .ok_or_else(|| self.err(format!("{name}: size {size:?} stride {stride:?} overflows")))?;
                    }
                }
                if !empty && last >= storage.numel {
                    return Err(self.err(format!(
                        "tensor (offset {offset}, size {size:?}, stride {stride:?}) reaches element {last} of storage {} which has {} elements",
                        storage.key, storage.numel
                    )));
                }
                Ok(Val::Tensor(Rc::new(TensorRef { storage, offset, size, stride })))
            }
            ("torch._utils", "_rebuild_parameter") | ("torch._utils", "_rebuild_parameter_with_state") => {
                match args.first() {
                    Some(t @ Val::Tensor(_)) => Ok(t.clone()),
                    _ => Err(self.err(format!("{name}: first argument is not a tensor"))),
                }
            }
            _ => Ok(Val::Object(Rc::new(Obj { class: format!("{module}.{name}") }))),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Reading a checkpoint
// ------------------------------------------------------------------------------------------------

/// Read every state dict in a `torch.save` zip file (a bare state dict, or a dict holding state
/// dicts such as Med-DDPM's `{'step', 'model', 'ema'}`), converting every tensor to f32.
pub fn read_state_dicts(path: impl AsRef<Path>) -> Result<TorchCheckpoint> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let not_torch = |why: String| Error::format(path, format!("not a PyTorch checkpoint: {why}"));
    if bytes.len() >= 2 && bytes[0] == 0x80 && bytes[1] <= 5 {
        return Err(not_torch(
            "this is the legacy (pre-1.6, non-zip) torch.save format, which is not supported; \
             re-save it in PyTorch with torch.save(torch.load(f), f)"
                .into(),
        ));
    }
    if bytes.len() < 4 || &bytes[..4] != b"PK\x03\x04" {
        let head: String = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return Err(not_torch(format!("not a zip archive (starts with {head}, {} bytes)", bytes.len())));
    }
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(&bytes[..]))
        .map_err(|e| not_torch(format!("unreadable zip archive ({e}); is the file truncated?")))?;
    let names: Vec<String> = zip.file_names().filter_map(|n| n.ok()).map(|n| n.to_string()).collect();
    let pkl: Vec<&String> = names.iter().filter(|n| n.ends_with("data.pkl") && n.matches('/').count() <= 1).collect();
    let pkl_name = match pkl.as_slice() {
        [one] => (*one).clone(),
        [] if names.iter().any(|n| n.ends_with("constants.pkl")) => {
            return Err(not_torch("a TorchScript archive (torch.jit.save), not a torch.save state dict".into()))
        }
        [] => return Err(not_torch(format!("the zip has no data.pkl (entries: {})", preview(&names)))),
        many => return Err(not_torch(format!("the zip has several data.pkl: {many:?}"))),
    };
    let prefix = pkl_name.trim_end_matches("data.pkl").to_string();
    let read_entry = |zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>, name: &str| -> Result<Vec<u8>> {
        let mut f = zip.by_name(name).map_err(|e| Error::format(path, format!("zip entry {name}: {e}")))?;
        let mut buf = Vec::with_capacity(f.size() as usize);
        f.read_to_end(&mut buf).map_err(|e| Error::format(path, format!("zip entry {name}: {e}")))?;
        Ok(buf)
    };
    let pickle = read_entry(&mut zip, &pkl_name)?;
    let big_endian = match names.iter().find(|n| **n == format!("{prefix}byteorder")) {
        Some(n) => {
            let b = read_entry(&mut zip, n)?;
            match b.as_slice() {
                b"little" => false,
                b"big" => true,
                other => return Err(not_torch(format!("byteorder entry says {:?}", String::from_utf8_lossy(other)))),
            }
        }
        None => false,
    };

    let top = Unpickler::new(&pickle, path).run()?;
    let top = match top {
        Val::Dict(d) => d,
        other => {
            return Err(not_torch(format!(
                "the saved object is a {}, expected a dict (a state dict, or a dict of state dicts)",
                other.kind()
            )))
        }
    };
    let top = top.borrow();

    let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
    let mut load = |t: &TensorRef, key: &str| -> Result<Vec<f32>> {
        let s = &t.storage;
        if !storages.contains_key(&s.key) {
            let name = format!("{prefix}data/{}", s.key);
            if !names.contains(&name) {
                return Err(Error::format(path, format!("tensor {key}: storage entry {name} is missing from the zip")));
            }
            let buf = read_entry(&mut zip, &name)?;
            let need = s.numel * s.dtype.size();
            if buf.len() < need {
                return Err(Error::format(
                    path,
                    format!(
                        "tensor {key}: storage {name} ({}, {}) has {} bytes, the pickle says {} elements of {:?} = {need} bytes",
                        s.location,
                        s.key,
                        buf.len(),
                        s.numel,
                        s.dtype
                    ),
                ));
            }
            storages.insert(s.key.clone(), buf);
        }
        Ok(materialise(t, &storages[&s.key], big_endian))
    };

    // a dict is a state dict when every value is a tensor (and it has at least one)
    let tensor_entries = |d: &[(Val, Val)]| -> Option<Vec<(String, Rc<TensorRef>)>> {
        if d.is_empty() {
            return None;
        }
        d.iter()
            .map(|(k, v)| match (k, v) {
                (Val::Str(k), Val::Tensor(t)) => Some((k.clone(), t.clone())),
                _ => None,
            })
            .collect()
    };
    let mut out =
        TorchCheckpoint { path: path.to_path_buf(), step: None, dicts: BTreeMap::new(), storage_locations: Vec::new() };
    let mut locations = std::collections::BTreeSet::new();
    let mut convert = |entries: Vec<(String, Rc<TensorRef>)>| -> Result<StateDict> {
        entries
            .into_iter()
            .map(|(k, t)| {
                locations.insert(t.storage.location.clone());
                Ok((k.clone(), t.size.clone(), load(&t, &k)?))
            })
            .collect()
    };
    if let Some(entries) = tensor_entries(&top) {
        out.dicts.insert(String::new(), convert(entries)?);
        out.storage_locations = locations.into_iter().collect();
        return Ok(out);
    }
    let mut top_keys = Vec::new();
    for (k, v) in top.iter() {
        let k = match k {
            Val::Str(s) => s.clone(),
            Val::Int(i) => i.to_string(),
            other => format!("<{}>", other.kind()),
        };
        top_keys.push(k.clone());
        match v {
            Val::Int(i) if k == "step" => out.step = Some(*i),
            Val::Dict(d) => {
                let d = d.borrow();
                if let Some(entries) = tensor_entries(&d) {
                    out.dicts.insert(k, convert(entries)?);
                } else if d.iter().any(|(_, v)| matches!(v, Val::Tensor(_))) {
                    let odd: Vec<String> = d
                        .iter()
                        .filter(|(_, v)| !matches!(v, Val::Tensor(_)))
                        .map(|(k, v)| format!("{} ({})", key_str(k), v.kind()))
                        .collect();
                    return Err(Error::format(
                        path,
                        format!("dict {k:?} mixes tensors with other values: {}", preview(&odd)),
                    ));
                }
            }
            _ => {}
        }
    }
    if out.dicts.is_empty() {
        return Err(not_torch(format!("no state dict (a dict of tensors) in it; top-level keys: {top_keys:?}")));
    }
    out.storage_locations = locations.into_iter().collect();
    Ok(out)
}

fn key_str(k: &Val) -> String {
    match k {
        Val::Str(s) => s.clone(),
        Val::Int(i) => i.to_string(),
        other => format!("<{}>", other.kind()),
    }
}

fn preview(items: &[String]) -> String {
    let mut s = items.iter().take(12).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > 12 {
        s += &format!(", ... ({} in all)", items.len());
    }
    s
}

/// Gather a (possibly strided) tensor view into contiguous row-major f32.
fn materialise(t: &TensorRef, buf: &[u8], big_endian: bool) -> Vec<f32> {
    let es = t.storage.dtype.size();
    let n: usize = t.size.iter().product();
    let dtype = t.storage.dtype;
    let elem = |i: usize| -> f32 {
        let b = &buf[i * es..(i + 1) * es];
        if big_endian {
            let mut le = [0u8; 8];
            for (j, &x) in b.iter().rev().enumerate() {
                le[j] = x;
            }
            dtype.to_f32(&le[..es])
        } else {
            dtype.to_f32(b)
        }
    };
    // contiguous fast path
    let mut contiguous = true;
    let mut expect = 1usize;
    for (&sz, &st) in t.size.iter().zip(&t.stride).rev() {
        if sz != 1 && st != expect {
            contiguous = false;
        }
        expect *= sz;
    }
    if contiguous {
        return (t.offset..t.offset + n).map(elem).collect();
    }
    let rank = t.size.len();
    let mut idx = vec![0usize; rank];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let src = t.offset + idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
        out.push(elem(src));
        for d in (0..rank).rev() {
            idx[d] += 1;
            if idx[d] < t.size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

// ------------------------------------------------------------------------------------------------
// Schedule buffers
// ------------------------------------------------------------------------------------------------

/// The 13 buffers of the cosine schedule for `t` steps as the reference stores them (float32),
/// from [`Schedule`] (spec §3.1), in [`SCHEDULE_BUFFERS`] order.
pub fn schedule_buffers(t: usize) -> Vec<(&'static str, Vec<f32>)> {
    let sched = Schedule::cosine(t);
    SCHEDULE_BUFFERS.iter().map(|&n| (n, sched.buffer(n).expect("every buffer name is known"))).collect()
}

/// Schedule buffers found in a dict: name → (shape, values).
type Buffers<'a> = BTreeMap<&'a str, (&'a Vec<usize>, &'a Vec<f32>)>;

/// Compare a file's schedule buffers with ours; one warning per mismatching or missing buffer.
fn check_schedule(found: &Buffers) -> Vec<String> {
    let mut warnings = Vec::new();
    if found.is_empty() {
        return warnings; // a bare U-Net dict has none
    }
    let t = found.get("betas").map(|(s, _)| s.iter().product::<usize>()).unwrap_or(250);
    if t != 250 {
        warnings.push(format!(
            "schedule buffer betas has T = {t} steps; Med-DDPM (and this engine's sampler) uses T = 250"
        ));
    }
    if t < 2 {
        return warnings;
    }
    for (name, want) in schedule_buffers(t) {
        match found.get(name) {
            None => warnings.push(format!("schedule buffer {name} is missing")),
            Some((shape, got)) => {
                if got.len() != want.len() {
                    warnings.push(format!("schedule buffer {name} has shape {shape:?}, expected [{t}]"));
                    continue;
                }
                let bad = got.iter().zip(&want).enumerate().find(|(_, (&g, &w))| {
                    let (g, w) = (g as f64, w as f64);
                    !((g - w).abs() <= 1e-5 * w.abs() + 1e-12 || (g.is_infinite() && g == w))
                });
                if let Some((i, (g, w))) = bad {
                    warnings.push(format!(
                        "schedule buffer {name} differs from the cosine schedule (T = {t}, s = 0.008) at index {i}: file {g:e}, expected {w:e}; the model may have been trained with another schedule"
                    ));
                }
            }
        }
    }
    warnings
}

// ------------------------------------------------------------------------------------------------
// Mapping onto the U-Net
// ------------------------------------------------------------------------------------------------

/// U-Net parameters in [`param_specs`] order, plus non-fatal findings (schedule buffers).
#[derive(Clone, Debug)]
pub struct MappedUNet {
    pub params: Vec<Vec<f32>>,
    pub warnings: Vec<String>,
}

/// Shapes are equal, or equal once trailing 1s are dropped (a Conv1d weight (3C, C, 1) stored
/// as (3C, C), a 1×1×1 skip conv stored as a matrix): the element order is the same.
fn shapes_match(got: &[usize], want: &[usize]) -> bool {
    let trim = |s: &[usize]| s.iter().rposition(|&d| d != 1).map_or(0, |p| p + 1);
    got == want || got[..trim(got)] == want[..trim(want)]
}

/// Strip `denoise_fn.`, split off the schedule buffers, and check every U-Net key and shape
/// against `cfg`. The error lists every missing, unexpected and wrong-shaped key.
fn split_dict<'a>(dict: &'a [(String, Vec<usize>, Vec<f32>)], cfg: &UNetConfig) -> Result<(Vec<usize>, Buffers<'a>)> {
    let specs = param_specs(cfg);
    let index: HashMap<&str, usize> = specs.iter().enumerate().map(|(i, s)| (s.key.as_str(), i)).collect();
    let mut slot: Vec<Option<usize>> = vec![None; specs.len()];
    let mut buffers = BTreeMap::new();
    let (mut unexpected, mut wrong, mut dup) = (Vec::new(), Vec::new(), Vec::new());
    for (j, (key, shape, data)) in dict.iter().enumerate() {
        if let Some(b) = SCHEDULE_BUFFERS.iter().find(|b| **b == key.as_str()) {
            buffers.insert(*b, (shape, data));
            continue;
        }
        let k = key.strip_prefix(DENOISE_PREFIX).unwrap_or(key);
        match index.get(k) {
            None => unexpected.push(format!("{key} {shape:?}")),
            Some(&i) => {
                if !shapes_match(shape, &specs[i].shape) {
                    wrong.push(format!("{k}: file {shape:?}, model {:?}", specs[i].shape));
                } else if slot[i].is_some() {
                    dup.push(k.to_string());
                } else {
                    slot[i] = Some(j);
                }
            }
        }
    }
    let missing: Vec<String> = specs
        .iter()
        .zip(&slot)
        .filter(|(s, j)| j.is_none() && !wrong.iter().any(|w| w.starts_with(&format!("{}:", s.key))))
        .map(|(s, _)| format!("{} {:?}", s.key, s.shape))
        .collect();
    if !(missing.is_empty() && unexpected.is_empty() && wrong.is_empty() && dup.is_empty()) {
        let mut msg = format!(
            "{} tensors expected for config (in {}, out {}, model_channels {}, channel_mult {:?}, num_res_blocks {}, attention_ds {:?}), file has {}",
            specs.len(),
            cfg.in_channels,
            cfg.out_channels,
            cfg.model_channels,
            cfg.channel_mult,
            cfg.num_res_blocks,
            cfg.attention_ds,
            dict.len() - buffers.len()
        );
        for (what, list) in
            [("missing", &missing), ("unexpected", &unexpected), ("wrong shape", &wrong), ("duplicated", &dup)]
        {
            if !list.is_empty() {
                msg += &format!("\n  {what} ({}): {}", list.len(), list.join(", "));
            }
        }
        return Err(Error::Checkpoint { path: PathBuf::from("<state dict>"), msg });
    }
    Ok((slot.into_iter().map(|j| j.expect("checked: nothing missing")).collect(), buffers))
}

/// Our U-Net's parameters from a PyTorch state dict (with or without `denoise_fn.`), in
/// [`param_specs`] order, after checking every key and shape; the schedule buffers, when present,
/// are compared with the cosine schedule and any difference is returned as a warning naming it.
pub fn map_to_unet(dict: &[(String, Vec<usize>, Vec<f32>)], cfg: &UNetConfig) -> Result<MappedUNet> {
    let (slots, buffers) = split_dict(dict, cfg)?;
    let params = slots.into_iter().map(|j| dict[j].2.clone()).collect();
    Ok(MappedUNet { params, warnings: check_schedule(&buffers) })
}

/// [`infer_config_from_shapes`] on a state dict.
pub fn infer_config(dict: &[(String, Vec<usize>, Vec<f32>)], depth: usize, size: usize) -> Result<UNetConfig> {
    let shapes: Vec<(String, Vec<usize>)> = dict.iter().map(|(k, s, _)| (k.clone(), s.clone())).collect();
    infer_config_from_shapes(&shapes, depth, size)
}

/// The U-Net configuration a state dict was made with, read off its keys and shapes: in/out
/// channels, model_channels, channel_mult, num_res_blocks and attention_ds. What shapes cannot
/// tell is taken from the arguments (depth, size) or from Med-DDPM (num_heads 1, groups 32).
/// The result is checked against every key and shape of the dict.
pub fn infer_config_from_shapes(dict: &[(String, Vec<usize>)], depth: usize, size: usize) -> Result<UNetConfig> {
    let fail = |msg: String| Error::Checkpoint { path: PathBuf::from("<state dict>"), msg };
    let shapes: HashMap<&str, &Vec<usize>> =
        dict.iter().map(|(k, s)| (k.strip_prefix(DENOISE_PREFIX).unwrap_or(k), s)).collect();
    let get = |k: &str, rank: usize| -> Result<&Vec<usize>> {
        match shapes.get(k) {
            Some(s) if s.len() == rank => Ok(*s),
            Some(s) => Err(fail(format!("{k} has shape {s:?}, expected rank {rank}: not a Med-DDPM U-Net"))),
            None => Err(fail(format!("{k} is missing: not a Med-DDPM U-Net state dict"))),
        }
    };
    let te = get("time_embed.0.weight", 2)?;
    let (emb, mc) = (te[0], te[1]);
    if emb != 4 * mc {
        return Err(fail(format!("time_embed.0.weight is {te:?}, expected [4·mc, mc]")));
    }
    let in_channels = get("input_blocks.0.0.weight", 5)?[1];
    let out_channels = get("out.2.weight", 5)?[0];
    let (mut widths, mut level_counts, mut attention_ds) = (vec![Vec::new()], vec![0usize], Vec::new());
    let mut ds = 1usize;
    for i in 1.. {
        if shapes.contains_key(format!("input_blocks.{i}.0.op.weight").as_str()) {
            widths.push(Vec::new());
            level_counts.push(0);
            ds *= 2;
        } else if let Some(s) = shapes.get(format!("input_blocks.{i}.0.in_layers.2.weight").as_str()) {
            widths.last_mut().expect("non-empty").push(s[0]);
            *level_counts.last_mut().expect("non-empty") += 1;
            if shapes.contains_key(format!("input_blocks.{i}.1.qkv.weight").as_str()) && !attention_ds.contains(&ds) {
                attention_ds.push(ds);
            }
        } else {
            break;
        }
    }
    let nrb = level_counts[0];
    if nrb == 0 || level_counts.iter().any(|&c| c != nrb) {
        return Err(fail(format!("res blocks per level {level_counts:?} are not all equal and > 0")));
    }
    let mut channel_mult = Vec::new();
    for (level, w) in widths.iter().enumerate() {
        if w.iter().any(|&c| c != w[0]) || w[0] % mc != 0 {
            return Err(fail(format!("level {level} widths {w:?} are not one multiple of model_channels {mc}")));
        }
        channel_mult.push(w[0] / mc);
    }
    let cfg = UNetConfig {
        depth,
        size,
        in_channels,
        out_channels,
        model_channels: mc,
        channel_mult,
        num_res_blocks: nrb,
        attention_ds,
        num_heads: 1,
        groups: 32,
    };
    let f = 1usize << (cfg.levels() - 1);
    if depth % f != 0 || size % f != 0 || depth == 0 || size == 0 {
        return Err(Error::Config(format!(
            "depth {depth} and size {size} must be positive multiples of {f} for a {}-level U-Net",
            cfg.levels()
        )));
    }
    let fake: Vec<(String, Vec<usize>, Vec<f32>)> =
        dict.iter().map(|(k, s)| (k.clone(), s.clone(), Vec::new())).collect();
    split_dict(&fake, &cfg).map_err(|e| match e {
        Error::Checkpoint { msg, .. } => fail(format!("inferred {cfg:?}, but the dict does not match it: {msg}")),
        e => e,
    })?;
    Ok(cfg)
}

// ------------------------------------------------------------------------------------------------
// Export
// ------------------------------------------------------------------------------------------------

/// Write U-Net parameters to a safetensors file under PyTorch's keys and shapes (Conv1d weights
/// keep their trailing 1), so `UNetModel.load_state_dict` accepts it as it is; with
/// `diffusion_keys` the keys get `denoise_fn.` and the 13 schedule buffers (T = 250) are added,
/// as `GaussianDiffusion.load_state_dict` expects. Metadata: `format` = `meddpm-state-dict` and
/// `unet` = the config (as [`crate::checkpoint::export_state_dict`] writes), plus `metadata`.
/// The write is atomic ([`write_atomic`]): an existing `out` is replaced only by a complete file.
pub fn export_safetensors(
    out: &Path,
    cfg: &UNetConfig,
    params: &[Vec<f32>],
    diffusion_keys: bool,
    metadata: BTreeMap<String, String>,
) -> Result<()> {
    let specs = param_specs(cfg);
    if specs.len() != params.len() {
        return Err(Error::Config(format!("{} parameter tensors given, the config has {}", params.len(), specs.len())));
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    if diffusion_keys {
        for (name, v) in schedule_buffers(250) {
            tensors.push((name.to_string(), vec![v.len()], v));
        }
    }
    for (s, p) in specs.iter().zip(params) {
        if s.numel() != p.len() {
            return Err(Error::Config(format!("{}: {} values for shape {:?}", s.key, p.len(), s.shape)));
        }
        let key = if diffusion_keys { format!("{DENOISE_PREFIX}{}", s.key) } else { s.key.clone() };
        tensors.push((key, s.shape.clone(), p.clone()));
    }
    let mut meta: HashMap<String, String> = metadata.into_iter().collect();
    meta.insert("format".into(), "meddpm-state-dict".into());
    meta.insert("unet".into(), serde_json::to_string(cfg).expect("config serialises"));
    write_atomic(out, &serialize(&tensors, meta)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_matches_known_values() {
        // closed forms: 1.0, -2.0, 65504 (max), 2^-14 (min normal), 2^-24 (min subnormal), inf
        for (h, f) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0400, 2f32.powi(-14)),
            (0x0001, 2f32.powi(-24)),
            (0x0200, 2f32.powi(-15)),
            (0x8000, -0.0),
            (0x7c00, f32::INFINITY),
        ] {
            assert_eq!(f16_to_f32(h), f, "0x{h:04x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn schedule_matches_spec_values() {
        // spec §3.1: β₀ = 1.94269e-4, β₁₂₄ = 0.012466, β₂₄₉ = 0.999, ᾱ₁₂₄ = 0.4938, ᾱ₂₄₉ = 3.886e-8
        let b = schedule_buffers(250);
        let get = |n: &str| b.iter().find(|(k, _)| *k == n).unwrap().1.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let close = |a: f64, e: f64, tol: f64| assert!((a - e).abs() <= tol * e.abs(), "{a} vs {e}");
        close(get("betas")[0], 1.94269e-4, 1e-5);
        close(get("betas")[124], 0.012466, 1e-4);
        assert_eq!(get("betas")[249], 0.999f32 as f64);
        close(get("alphas_cumprod")[124], 0.4938, 1e-3);
        close(get("alphas_cumprod")[249], 3.886e-8, 1e-3);
        assert_eq!(get("posterior_mean_coef1")[0], 1.0);
        assert_eq!(get("posterior_variance")[0], 0.0);
        assert_eq!(b.len(), 13);
        assert!(b.iter().zip(SCHEDULE_BUFFERS).all(|((n, v), m)| *n == m && v.len() == 250));
    }

    #[test]
    fn pickle_opcodes_build_values() {
        // hand-assembled protocol-2 pickle: {'a': [1, -2, 300, 70000, 2**40], 'b': (True, None, 1.5)}
        let mut p = vec![0x80, 2, b'}', b'q', 0, b'(', b'X', 1, 0, 0, 0, b'a', b']', b'(', b'K', 1];
        p.extend([0x8a, 1, 0xfe]); // LONG1 -2
        p.extend([b'M', 0x2c, 0x01]); // 300
        p.extend([b'J', 0x70, 0x11, 0x01, 0x00]); // 70000
        p.extend([0x8a, 6, 0, 0, 0, 0, 0, 1]); // 2^40
        p.extend([b'e', b'X', 1, 0, 0, 0, b'b', 0x88, b'N', b'G']);
        p.extend(1.5f64.to_be_bytes());
        p.extend([0x87, b'u', b'.']);
        let v = Unpickler::new(&p, Path::new("t")).run().unwrap();
        let Val::Dict(d) = v else { panic!("not a dict") };
        let d = d.borrow();
        let Val::List(l) = &d[0].1 else { panic!() };
        let ints: Vec<i64> = l.borrow().iter().map(|v| if let Val::Int(i) = v { *i } else { panic!() }).collect();
        assert_eq!(ints, vec![1, -2, 300, 70000, 1 << 40]);
        let Val::Tuple(t) = &d[1].1 else { panic!() };
        assert!(
            matches!(t[0], Val::Bool(true)) && matches!(t[1], Val::None) && matches!(t[2], Val::Float(f) if f == 1.5)
        );
        // truncation and garbage give errors with a byte offset, never a panic
        for cut in 0..p.len() - 1 {
            assert!(Unpickler::new(&p[..cut], Path::new("t")).run().is_err(), "cut {cut}");
        }
        let e = Unpickler::new(&[0x80, 2, 0xff], Path::new("t")).run().unwrap_err().to_string();
        assert!(e.contains("unsupported pickle opcode 0xff") && e.contains("byte 2"), "{e}");
    }

    #[test]
    fn strided_views_are_gathered() {
        // storage 0..12 as f32; view offset 1, size (2, 3), stride (1, 4) = transpose-like
        let buf: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let s = Rc::new(StorageRef { dtype: DType::F32, key: "0".into(), location: "cpu".into(), numel: 12 });
        let t = TensorRef { storage: s, offset: 1, size: vec![2, 3], stride: vec![1, 4] };
        assert_eq!(materialise(&t, &buf, false), vec![1.0, 5.0, 9.0, 2.0, 6.0, 10.0]);
        let be: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_be_bytes()).collect();
        assert_eq!(materialise(&t, &be, true), vec![1.0, 5.0, 9.0, 2.0, 6.0, 10.0]);
    }
}
