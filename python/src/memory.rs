//! What `Pd.register` takes: the memory behind a Python object, found without copying through
//! DLPack (`__dlpack__`: torch tensors on the host or a GPU, CuPy, JAX, NumPy ≥ 1.22),
//! `__cuda_array_interface__` (CuPy, Numba, torch CUDA tensors) or the buffer protocol
//! (NumPy, `bytearray`, `memoryview`), in that order of preference for GPU memory and the
//! buffer protocol first for host memory. The result says where the bytes are and keeps the
//! object's memory alive (and, for DLPack, returns it to its producer) until it is dropped.

use crate::errors;
use pyo3::buffer::PyBuffer;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use std::ffi::{c_void, CStr};

/// DLPack device types (dlpack.h, `DLDeviceType`).
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

/// `DLTensor` of dlpack.h (ABI version 0.x/1.x, unchanged layout).
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    dtype_code: u8,
    dtype_bits: u8,
    dtype_lanes: u16,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` of dlpack.h: what a `"dltensor"` capsule points at.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Where the bytes of an imported object live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory (pageable or pinned).
    Host,
    /// Device memory of GPU `ordinal`.
    Gpu(usize),
}

/// An object's memory, held for as long as a registration needs it.
pub(crate) struct Imported {
    pub addr: u64,
    pub len: u64,
    pub place: Place,
    pub readonly: bool,
    _hold: Hold,
}

enum Hold {
    Buffer(#[allow(dead_code)] PyBuffer<u8>),
    Object(#[allow(dead_code)] Py<PyAny>),
    DlPack(#[allow(dead_code)] DlPackHold),
}

/// A consumed DLPack tensor: its producer's deleter runs when this drops.
struct DlPackHold(*mut DlManagedTensor);

// SAFETY: the managed tensor is only touched again by its deleter, which DLPack allows from
// any thread (producers hand their own reference counting to it).
unsafe impl Send for DlPackHold {}
// SAFETY: as above; nothing reads through the pointer after the import.
unsafe impl Sync for DlPackHold {}

impl Drop for DlPackHold {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a "dltensor" capsule this crate renamed to
        // "used_dltensor", so the deleter is ours to call, once.
        unsafe {
            if let Some(d) = (*self.0).deleter {
                d(self.0);
            }
        }
    }
}

/// The memory of `obj`: host objects through the buffer protocol (then DLPack), GPU objects
/// through DLPack (then `__cuda_array_interface__`). Non-contiguous, empty, managed-memory
/// and other devices' objects are refused with `InvalidArgument`.
pub(crate) fn import(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    if let Some(i) = buffer(obj)? {
        return Ok(i);
    }
    if obj.hasattr("__dlpack__")? {
        return dlpack(obj);
    }
    if obj.hasattr("__cuda_array_interface__")? {
        return cuda_array_interface(obj);
    }
    Err(errors::InvalidArgument::new_err(format!(
        "register needs an object with DLPack (__dlpack__), __cuda_array_interface__ or the \
         buffer protocol; {} has none",
        obj.get_type().name()?
    )))
}

/// The buffer protocol, as bytes whatever the element type (`memoryview(obj).cast("B")`);
/// `None` when the object has no buffer.
fn buffer(obj: &Bound<'_, PyAny>) -> PyResult<Option<Imported>> {
    let Ok(view) = obj
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
    else {
        return Ok(None);
    };
    let buf = view
        .call_method1("cast", ("B",))
        .and_then(|v| PyBuffer::<u8>::get(&v))
        .map_err(|e| {
            errors::InvalidArgument::new_err(format!("register needs a C-contiguous buffer: {e}"))
        })?;
    Ok(Some(Imported {
        addr: buf.buf_ptr() as u64,
        len: buf.len_bytes() as u64,
        place: Place::Host,
        readonly: buf.readonly(),
        _hold: Hold::Buffer(buf),
    }))
}

/// Bytes of `shape` elements of `itemsize` bytes laid out by `strides` (in elements; `None`
/// for C order), or why not: the registration covers one contiguous range.
fn contiguous_len(shape: &[i64], strides: Option<&[i64]>, itemsize: u64) -> PyResult<u64> {
    let mut expect = 1i64;
    let mut count = 1u64;
    for (i, &n) in shape.iter().enumerate().rev() {
        if n < 0 {
            return Err(errors::InvalidArgument::new_err(format!("shape {shape:?}")));
        }
        if let Some(s) = strides {
            if n > 1 && s[i] != expect {
                return Err(errors::InvalidArgument::new_err(format!(
                    "register needs C-contiguous memory; shape {shape:?} has strides {s:?} \
                     (elements): pass .contiguous() / a copy"
                )));
            }
        }
        expect = expect.saturating_mul(n.max(1));
        count = count
            .checked_mul(n as u64)
            .ok_or_else(|| errors::InvalidArgument::new_err("element count overflows"))?;
    }
    count
        .checked_mul(itemsize)
        .ok_or_else(|| errors::InvalidArgument::new_err("byte count overflows"))
}

fn dlpack(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let cap = obj.call_method0("__dlpack__")?;
    let cap = cap
        .cast::<PyCapsule>()
        .map_err(|_| errors::InvalidArgument::new_err("__dlpack__ did not return a capsule"))?;
    const NAME: &CStr = c"dltensor";
    const USED: &CStr = c"used_dltensor";
    // SAFETY: `cap` is a live capsule; a wrong name is reported as NULL (with an exception
    // set, which PyErr::fetch takes).
    let ptr = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), NAME.as_ptr()) };
    if ptr.is_null() {
        let e = PyErr::fetch(obj.py());
        return Err(errors::InvalidArgument::new_err(format!(
            "__dlpack__ returned no unused \"dltensor\" capsule: {e}"
        )));
    }
    // SAFETY: renaming marks the capsule consumed, so its destructor leaves the tensor to us
    // (DLPack's protocol); `USED` is a static string.
    if unsafe { ffi::PyCapsule_SetName(cap.as_ptr(), USED.as_ptr()) } != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    let hold = DlPackHold(ptr.cast());
    // SAFETY: a "dltensor" capsule points at a DLManagedTensor that stays valid until its
    // deleter runs (when `hold` drops); shape (and strides, when not NULL) have ndim entries.
    let (t, shape, strides) = unsafe {
        let t = &(*hold.0).dl_tensor;
        let nd = usize::try_from(t.ndim).unwrap_or(0);
        let shape: &[i64] = if nd == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(t.shape, nd)
        };
        let strides =
            (!t.strides.is_null() && nd > 0).then(|| std::slice::from_raw_parts(t.strides, nd));
        (t, shape, strides)
    };
    let bits = u64::from(t.dtype_bits) * u64::from(t.dtype_lanes.max(1));
    if bits % 8 != 0 {
        return Err(errors::InvalidArgument::new_err(format!(
            "elements of {bits} bits are not whole bytes"
        )));
    }
    let len = contiguous_len(shape, strides, bits / 8)?;
    let place = match t.device_type {
        DL_CPU | DL_CUDA_HOST => Place::Host,
        DL_CUDA => Place::Gpu(usize::try_from(t.device_id).unwrap_or(0)),
        other => {
            return Err(errors::InvalidArgument::new_err(format!(
                "DLPack device type {other} (only CPU {DL_CPU}, CUDA {DL_CUDA} and pinned \
                 CUDA host {DL_CUDA_HOST} memory can be registered; not managed memory)"
            )))
        }
    };
    Ok(Imported {
        addr: (t.data as u64).wrapping_add(t.byte_offset),
        len,
        place,
        readonly: false,
        _hold: Hold::DlPack(hold),
    })
}

fn cuda_array_interface(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let bad =
        |what: &str| errors::InvalidArgument::new_err(format!("__cuda_array_interface__: {what}"));
    let cai = obj.getattr("__cuda_array_interface__")?;
    let cai = cai.cast::<PyDict>().map_err(|_| bad("not a dict"))?;
    let get = |k: &str| {
        cai.get_item(k)
            .ok()
            .flatten()
            .ok_or_else(|| bad(&format!("no {k:?}")))
    };
    let data = get("data")?;
    let data = data
        .cast::<PyTuple>()
        .map_err(|_| bad("data is not a tuple"))?;
    let addr: u64 = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    let shape: Vec<i64> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let itemsize: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .filter(|n: &u64| *n > 0)
        .ok_or_else(|| bad(&format!("typestr {typestr:?}")))?;
    let strides: Option<Vec<i64>> = match cai.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    // strides are in bytes here
    let elems = strides
        .map(|s| {
            s.iter()
                .map(|b| {
                    if *b % itemsize as i64 == 0 {
                        Ok(b / itemsize as i64)
                    } else {
                        Err(())
                    }
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| bad("strides are not whole elements"))
        })
        .transpose()?;
    let len = contiguous_len(&shape, elems.as_deref(), itemsize)?;
    let ordinal = if len == 0 || addr == 0 {
        0
    } else {
        softnic_cuda::device_allocation(addr)
            .map(|a| a.ordinal)
            .ok_or_else(|| bad(&format!("{addr:#x} is not device memory of a GPU")))?
    };
    Ok(Imported {
        addr,
        len,
        place: Place::Gpu(ordinal),
        readonly,
        _hold: Hold::Object(obj.clone().unbind()),
    })
}

#[cfg(test)]
mod tests {
    use super::contiguous_len;

    #[test]
    fn c_order_is_contiguous_and_others_are_not() {
        assert_eq!(contiguous_len(&[4, 8], None, 2).unwrap(), 64);
        assert_eq!(contiguous_len(&[4, 8], Some(&[8, 1]), 2).unwrap(), 64);
        // a dimension of one may have any stride
        assert_eq!(contiguous_len(&[1, 8], Some(&[99, 1]), 4).unwrap(), 32);
        assert_eq!(contiguous_len(&[], None, 4).unwrap(), 4);
        assert!(contiguous_len(&[4, 8], Some(&[1, 4]), 2).is_err());
        assert!(contiguous_len(&[i64::MAX, 4], None, 8).is_err());
        assert!(contiguous_len(&[-1], None, 8).is_err());
    }
}
