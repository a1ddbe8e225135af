//! Device selection, the public face of the backends: which NIC backs a [`Context`], chosen
//! automatically or by name, with the choice and its reason logged and queryable (the code
//! lives in the crate's `backend` module).

pub use crate::backend::context::Context;
pub use crate::backend::soft::{parse_softnic_addr, SOFTNIC_ADDR_ENV};
pub use crate::backend::{BackendKind, DeviceRequest, Selection, DEVICE_ENV};
