//! Python exception classes for the host API's errors and for error completions: one class per
//! kind of error, under `GpuverbsError`; error completions under `CompletionError`, one class
//! per syndrome a ConnectX reports, carrying the completion's fields as attributes.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    gpuverbs,
    GpuverbsError,
    PyException,
    "Every gpuverbs error."
);
create_exception!(
    gpuverbs,
    InvalidArgument,
    GpuverbsError,
    "A parameter is out of range."
);
create_exception!(
    gpuverbs,
    UnsupportedError,
    GpuverbsError,
    "The device cannot do this."
);
create_exception!(
    gpuverbs,
    NoSuchDeviceError,
    GpuverbsError,
    "No device with this name."
);
create_exception!(
    gpuverbs,
    BusyError,
    GpuverbsError,
    "Still used by work in flight or by other objects."
);
create_exception!(
    gpuverbs,
    PosterBusyError,
    GpuverbsError,
    "The QP already has a poster."
);
create_exception!(
    gpuverbs,
    QpStateError,
    GpuverbsError,
    "An illegal QP state transition."
);
create_exception!(
    gpuverbs,
    DrainError,
    GpuverbsError,
    "A recovery could not drain the QP in time."
);
create_exception!(
    gpuverbs,
    VerbsError,
    GpuverbsError,
    "An rdma-core call failed."
);
create_exception!(
    gpuverbs,
    CudaError,
    GpuverbsError,
    "CUDA failed or is absent."
);
create_exception!(
    gpuverbs,
    QueueFullError,
    GpuverbsError,
    "The send or receive queue is full: take completions first."
);
create_exception!(
    gpuverbs,
    CompletionTimeout,
    GpuverbsError,
    "No completion arrived within the timeout."
);
create_exception!(
    gpuverbs,
    CqOverrunError,
    GpuverbsError,
    "The CQ overran: completions were lost."
);
create_exception!(
    gpuverbs,
    CompletionError,
    GpuverbsError,
    "An error completion."
);
create_exception!(
    gpuverbs,
    LocalLengthError,
    CompletionError,
    "LOCAL_LENGTH (0x01)."
);
create_exception!(
    gpuverbs,
    LocalQpOperationError,
    CompletionError,
    "LOCAL_QP_OP (0x02)."
);
create_exception!(
    gpuverbs,
    LocalProtectionError,
    CompletionError,
    "LOCAL_PROT (0x04): a bad lkey or local range."
);
create_exception!(
    gpuverbs,
    FlushError,
    CompletionError,
    "WR_FLUSH (0x05): the QP is in error."
);
create_exception!(
    gpuverbs,
    RemoteInvalidRequestError,
    CompletionError,
    "REMOTE_INVAL_REQ (0x12)."
);
create_exception!(
    gpuverbs,
    RemoteAccessError,
    CompletionError,
    "REMOTE_ACCESS (0x13): a bad rkey, range or right."
);
create_exception!(
    gpuverbs,
    RemoteOperationError,
    CompletionError,
    "REMOTE_OP (0x14)."
);
create_exception!(
    gpuverbs,
    TransportRetryError,
    CompletionError,
    "TRANSPORT_RETRY_EXC (0x15): the peer does not answer."
);
create_exception!(
    gpuverbs,
    DescVersionError,
    GpuverbsError,
    "A kernel's device-API headers lay the QP descriptor out differently from this library."
);
create_exception!(
    gpuverbs,
    RnrRetryError,
    CompletionError,
    "RNR_RETRY_EXC (0x16): no receive posted at the peer."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    macro_rules! add {
        ($($t:ident),*) => { $(m.add(stringify!($t), py.get_type::<$t>())?;)* };
    }
    add!(
        GpuverbsError,
        InvalidArgument,
        UnsupportedError,
        NoSuchDeviceError,
        BusyError,
        PosterBusyError,
        QpStateError,
        DrainError,
        VerbsError,
        CudaError,
        QueueFullError,
        CompletionTimeout,
        CqOverrunError,
        DescVersionError,
        CompletionError,
        LocalLengthError,
        LocalQpOperationError,
        LocalProtectionError,
        FlushError,
        RemoteInvalidRequestError,
        RemoteAccessError,
        RemoteOperationError,
        TransportRetryError,
        RnrRetryError
    );
    Ok(())
}

/// A host-API error as its exception.
pub(crate) fn host(e: gpuverbs::Error) -> PyErr {
    use gpuverbs::Error as E;
    let msg = e.to_string();
    match e {
        E::NoSuchDevice(_) => NoSuchDeviceError::new_err(msg),
        E::InvalidArgument(_) | E::HostAlloc { .. } => InvalidArgument::new_err(msg),
        E::Unsupported(_) => UnsupportedError::new_err(msg),
        E::Busy(_) | E::InFlight(_) => BusyError::new_err(msg),
        E::PosterBusy { .. } => PosterBusyError::new_err(msg),
        E::Drain { .. } => DrainError::new_err(msg),
        E::Verbs { .. } => VerbsError::new_err(msg),
        E::Cuda(_) => CudaError::new_err(msg),
        E::DescVersion { .. } => DescVersionError::new_err(msg),
        E::Soft(s) => soft(s),
    }
}

/// A soft NIC error as its exception.
pub(crate) fn soft(e: gpuverbs::soft::Error) -> PyErr {
    let msg = e.to_string();
    match e {
        gpuverbs::soft::Error::IllegalTransition { .. } => QpStateError::new_err(msg),
        gpuverbs::soft::Error::InvalidArgument(_) => InvalidArgument::new_err(msg),
        _ => GpuverbsError::new_err(msg),
    }
}

/// A CPU initiator's error as its exception.
pub(crate) fn initiator(e: gpuverbs::post::InitiatorError) -> PyErr {
    use gpuverbs::post::InitiatorError as E;
    let msg = e.to_string();
    match e {
        E::SqFull { .. } | E::RqFull => QueueFullError::new_err(msg),
        E::Timeout(_) => CompletionTimeout::new_err(msg),
        E::CqOverrun(_) => CqOverrunError::new_err(msg),
        E::TooManySges(_) | E::Build(_) => InvalidArgument::new_err(msg),
    }
}

/// An error completion as its exception, with `syndrome` (the name), `syndrome_code`,
/// `vendor_syndrome`, `wqe_counter`, `opcode`, `qpn` and `responder` set on it.
pub(crate) fn completion(py: Python<'_>, e: &gpuverbs::post::ErrorCqe) -> PyErr {
    use gpuverbs::post::Syndrome as S;
    let syndrome = e.syndrome();
    let name = syndrome.map_or_else(
        || format!("UNKNOWN_{:#04x}", e.syndrome),
        |s| format!("{s:?}"),
    );
    let msg = format!(
        "{} completion {name} (syndrome {:#04x}, vendor {:#04x}) on QP {:#x}, WQE {}",
        if e.responder {
            "responder"
        } else {
            "requester"
        },
        e.syndrome,
        e.vendor_syndrome,
        e.qpn,
        e.wqe_counter
    );
    let err = match syndrome {
        Some(S::LocalLength) => LocalLengthError::new_err(msg),
        Some(S::LocalQpOp) => LocalQpOperationError::new_err(msg),
        Some(S::LocalProt) => LocalProtectionError::new_err(msg),
        Some(S::WrFlush) => FlushError::new_err(msg),
        Some(S::RemoteInvalReq) => RemoteInvalidRequestError::new_err(msg),
        Some(S::RemoteAccess) => RemoteAccessError::new_err(msg),
        Some(S::RemoteOp) => RemoteOperationError::new_err(msg),
        Some(S::TransportRetryExc) => TransportRetryError::new_err(msg),
        Some(S::RnrRetryExc) => RnrRetryError::new_err(msg),
        _ => CompletionError::new_err(msg),
    };
    let v = err.value(py);
    let set = |k: &str, val: Bound<'_, PyAny>| v.setattr(k, val);
    let attrs = (|| -> PyResult<()> {
        set("syndrome", name.into_pyobject(py)?.into_any())?;
        set("syndrome_code", e.syndrome.into_pyobject(py)?.into_any())?;
        set(
            "vendor_syndrome",
            e.vendor_syndrome.into_pyobject(py)?.into_any(),
        )?;
        set("wqe_counter", e.wqe_counter.into_pyobject(py)?.into_any())?;
        set("opcode", e.wqe_opcode.into_pyobject(py)?.into_any())?;
        set("qpn", e.qpn.into_pyobject(py)?.into_any())?;
        set(
            "responder",
            pyo3::types::PyBool::new(py, e.responder)
                .to_owned()
                .into_any(),
        )?;
        Ok(())
    })();
    match attrs {
        Ok(()) => err,
        Err(a) => a,
    }
}
