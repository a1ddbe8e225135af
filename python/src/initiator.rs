//! The CPU initiator from Python: WRITE, READ, SEND (with immediates), FETCH_ADD, CMP_SWP and
//! receives on registered regions, each checked against its region and the remote memory's
//! bounds; completions as `Completion`, error completions raised as their exception class.

use crate::errors;
use crate::region::{secs, Mr, RemoteMemory};
use gpuverbs::post::{CtrlFlags, Local, Op};
use pyo3::prelude::*;
use std::sync::Mutex;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Initiator>()?;
    m.add_class::<Completion>()?;
    Ok(())
}

/// A successful completion: `kind` (`"send"` for the requester's, `"recv"` for the
/// responder's), the WQE's `opcode`, `wqe_counter`, `byte_count`, `imm` (or None), `qpn`.
/// From `Qp.recover()` an error completion comes as one too, with `syndrome` set.
#[pyclass(frozen, get_all, module = "gpuverbs")]
#[derive(Clone, Debug)]
pub struct Completion {
    kind: &'static str,
    opcode: u8,
    wqe_counter: u16,
    byte_count: u32,
    imm: Option<u32>,
    qpn: u32,
    /// The syndrome's name for an error completion (only from `Qp.recover()`), else None.
    syndrome: Option<String>,
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl From<&gpuverbs::post::Completion> for Completion {
    fn from(c: &gpuverbs::post::Completion) -> Self {
        let base = Self {
            kind: "send",
            opcode: 0,
            wqe_counter: 0,
            byte_count: 0,
            imm: None,
            qpn: 0,
            syndrome: None,
        };
        match *c {
            gpuverbs::post::Completion::Req {
                wqe_opcode,
                qpn,
                wqe_counter,
                byte_cnt,
            } => Self {
                opcode: wqe_opcode,
                qpn,
                wqe_counter,
                byte_count: byte_cnt,
                ..base
            },
            gpuverbs::post::Completion::Resp {
                qpn,
                wqe_counter,
                byte_cnt,
                imm,
                ..
            } => Self {
                kind: "recv",
                qpn,
                wqe_counter,
                byte_count: byte_cnt,
                imm,
                ..base
            },
            gpuverbs::post::Completion::Error(e) => Self {
                kind: if e.responder { "recv" } else { "send" },
                opcode: e.wqe_opcode,
                qpn: e.qpn,
                wqe_counter: e.wqe_counter,
                syndrome: Some(e.syndrome().map_or_else(
                    || format!("UNKNOWN_{:#04x}", e.syndrome),
                    |s| format!("{s:?}"),
                )),
                ..base
            },
            gpuverbs::post::Completion::Invalid(op) => Self {
                opcode: op,
                syndrome: Some(format!("INVALID_{op:#04x}")),
                ..base
            },
        }
    }
}

/// A CPU initiator on one QP (`Qp.initiator()`): posts WQEs and rings, polls the QP's CQs.
/// The QP has this one poster until the initiator is dropped (`close()` or garbage).
#[pyclass(module = "gpuverbs")]
pub struct Initiator(Mutex<Option<gpuverbs::post::CpuInitiator>>);

impl Initiator {
    pub(crate) fn new(i: gpuverbs::post::CpuInitiator) -> Self {
        Self(Mutex::new(Some(i)))
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut gpuverbs::post::CpuInitiator) -> PyResult<T>,
    ) -> PyResult<T> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_mut() {
            Some(i) => f(i),
            None => Err(errors::InvalidArgument::new_err("the initiator is closed")),
        }
    }

    fn post(&self, op: &Op<'_>, signaled: bool) -> PyResult<u16> {
        let flags = if signaled {
            CtrlFlags::SIGNALED
        } else {
            CtrlFlags::default()
        };
        self.with(|i| i.post_and_ring(op, flags).map_err(errors::initiator))
    }

    /// Waits (GIL released) for the next completion of one queue.
    fn wait(&self, py: Python<'_>, recv: bool, timeout: f64) -> PyResult<Completion> {
        let t = secs(timeout)?;
        let c = py.detach(|| {
            self.with(|i| {
                let r = if recv { i.wait_recv(t) } else { i.wait_send(t) };
                r.map_err(errors::initiator)
            })
        })?;
        match c {
            gpuverbs::post::Completion::Error(e) => Err(errors::completion(py, &e)),
            c => Ok(Completion::from(&c)),
        }
    }
}

fn sge(mr: &Mr, off: u64, len: u32) -> PyResult<gpuverbs::post::Sge> {
    Ok(gpuverbs::post::Sge {
        addr: mr.local(off, u64::from(len))?,
        len,
        lkey: mr.mr.lkey(),
    })
}

#[pymethods]
impl Initiator {
    /// RDMA WRITE of `length` bytes at `offset` of `mr` to `remote_offset` of `remote`
    /// (with an immediate when `imm` is given). Returns the WQE's index.
    #[pyo3(signature = (mr, offset, length, remote, remote_offset = 0, imm = None, signaled = true))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        mr: &Mr,
        offset: u64,
        length: u32,
        remote: &RemoteMemory,
        remote_offset: u64,
        imm: Option<u32>,
        signaled: bool,
    ) -> PyResult<u16> {
        let s = [sge(mr, offset, length)?];
        let op = Op::Write {
            remote: remote.at(remote_offset, u64::from(length))?,
            local: Local::Sges(&s),
            imm,
        };
        self.post(&op, signaled)
    }
    /// RDMA READ of `length` bytes at `remote_offset` of `remote` into `offset` of `mr`.
    #[pyo3(signature = (mr, offset, length, remote, remote_offset = 0, signaled = true))]
    fn read(
        &self,
        mr: &Mr,
        offset: u64,
        length: u32,
        remote: &RemoteMemory,
        remote_offset: u64,
        signaled: bool,
    ) -> PyResult<u16> {
        let s = [sge(mr, offset, length)?];
        let op = Op::Read {
            remote: remote.at(remote_offset, u64::from(length))?,
            local: &s,
        };
        self.post(&op, signaled)
    }
    /// SEND of `length` bytes at `offset` of `mr` (with an immediate when `imm` is given).
    #[pyo3(signature = (mr, offset, length, imm = None, signaled = true))]
    fn send(
        &self,
        mr: &Mr,
        offset: u64,
        length: u32,
        imm: Option<u32>,
        signaled: bool,
    ) -> PyResult<u16> {
        let s = [sge(mr, offset, length)?];
        let op = Op::Send {
            local: Local::Sges(&s),
            imm,
        };
        self.post(&op, signaled)
    }
    /// 8-byte FETCH_ADD of `add` at `remote_offset` of `remote`; the old value lands at
    /// `offset` of `mr`.
    #[pyo3(signature = (mr, offset, remote, remote_offset, add))]
    fn fetch_add(
        &self,
        mr: &Mr,
        offset: u64,
        remote: &RemoteMemory,
        remote_offset: u64,
        add: u64,
    ) -> PyResult<u16> {
        let op = Op::FetchAdd {
            remote: remote.at(remote_offset, 8)?,
            add,
            result: sge(mr, offset, 8)?,
        };
        self.post(&op, true)
    }
    /// 8-byte COMPARE_SWAP at `remote_offset` of `remote`; the old value lands at `offset`
    /// of `mr`.
    #[pyo3(signature = (mr, offset, remote, remote_offset, compare, swap))]
    fn compare_swap(
        &self,
        mr: &Mr,
        offset: u64,
        remote: &RemoteMemory,
        remote_offset: u64,
        compare: u64,
        swap: u64,
    ) -> PyResult<u16> {
        let op = Op::CompareSwap {
            remote: remote.at(remote_offset, 8)?,
            compare,
            swap,
            result: sge(mr, offset, 8)?,
        };
        self.post(&op, true)
    }
    /// Posts a receive of `length` bytes at `offset` of `mr`. Returns its index.
    fn post_recv(&self, mr: &Mr, offset: u64, length: u32) -> PyResult<u16> {
        let s = [sge(mr, offset, length)?];
        self.with(|i| i.post_recv(&s).map_err(errors::initiator))
    }
    /// The next requester completion, waiting at most `timeout` seconds (GIL released);
    /// an error completion raises its `CompletionError` class.
    #[pyo3(signature = (timeout = 5.0))]
    fn wait_send(&self, py: Python<'_>, timeout: f64) -> PyResult<Completion> {
        self.wait(py, false, timeout)
    }
    /// The next receive completion, as `wait_send`.
    #[pyo3(signature = (timeout = 5.0))]
    fn wait_recv(&self, py: Python<'_>, timeout: f64) -> PyResult<Completion> {
        self.wait(py, true, timeout)
    }
    /// Send-queue blocks posted and not yet completed.
    #[getter]
    fn outstanding(&self) -> PyResult<u32> {
        self.with(|i| Ok(i.outstanding()))
    }
    /// Lets the QP go (another poster, or `Qp.recover()`, may take it).
    fn close(&self) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.take();
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    fn __exit__(
        &self,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.close();
    }
}
