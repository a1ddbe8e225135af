//! The ConnectX backend: the same host API over rdma-core's libibverbs and the mlx5 direct-verbs
//! interface (`mlx5dv_create_cq`, `mlx5dv_create_qp`, `mlx5dv_init_obj`), loaded at run time
//! through `rdma-core-sys`.
//!
//! Every object here is a thin owner of an rdma-core object: creation checks the result and
//! reports the call and errno ([`Error::Verbs`]), drop destroys it, and the rings, doorbell
//! records and BlueFlame register that `mlx5dv_init_obj` reveals are handed to the shared code
//! above as plain memory ranges (the CPU initiator, GPU export and proxy do not know which
//! backend made them). CQs are 64-byte-CQE CQs; QPs are RC with scatter-to-CQE disabled (so a
//! GPU poller never finds data inside a CQE). Rings are the provider's, in host memory, or
//! ([`devx`]) rings the host API placed itself (GPU memory, or modes the provider cannot give:
//! collapsed and overrun-ignore CQs), made with DEVX. DC initiators and targets ([`dc`]) are
//! the provider's, on host rings.
//!
//! Run here every day on the emulated device (`gpuverbs emu`: the real libibverbs and libmlx5
//! over the soft NIC); not run on ConnectX hardware.

mod dc;
mod device;
pub(crate) mod devx;
mod objects;
mod ops;

pub(crate) use device::{device_names, Device};
pub(crate) use ops::Mlx5Device;
