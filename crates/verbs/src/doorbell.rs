//! How a queue's producer tells the device about new WQEs: [`DoorbellMode`], one type from the
//! host API's options through the devices to the descriptor the kernels read ([`DoorbellMode::code`]).

/// How a queue's producer tells the device about new WQEs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DoorbellMode {
    /// The best the platform allows (resolved at QP creation, with the reason recorded); a
    /// device treats it as [`DoorbellMode::GpuDoorbell`].
    #[default]
    Auto,
    /// The producer (a kernel, or the CPU) writes the doorbell record and an 8-byte doorbell to
    /// the register; the device reads every WQE from the SQ ring.
    GpuDoorbell,
    /// The producer copies the whole WQE into the BlueFlame register; the device executes that
    /// WQE from the register copy (earlier ones from the ring). Writers store the WQE's bytes
    /// 8.. first and its first 8 bytes last, with release ordering.
    BlueFlame,
    /// A kernel publishes its producer index in host memory (the CPU-proxy word); a host
    /// thread rings 8-byte doorbells for it.
    CpuProxy,
    /// No send doorbell record (a ConnectX-8's `send_dbr_mode` 1, NO_DBR_EXT; DOCA GPUNetIO's
    /// `NIC_HANDLER_GPU_SM_NO_DBR`): the producer writes only an 8-byte doorbell, carrying its
    /// producer index, to the page's DBR-less register (`prm::doorbell::DBR_LESS_OFFSET`); the
    /// device never reads the record's send word, and nobody writes it.
    NoDbr,
    /// No doorbell record written by the producer, emulated in software for a device without
    /// the no-DBR mode (DOCA GPUNetIO's `SEND_DBR_MODE_EXT_NO_DBR_SW_EMULATED`, for a
    /// ConnectX-7 or older): the QP is an ordinary one, with a record. The producer stores
    /// its 64-bit producer index into the CPU-proxy word and an 8-byte doorbell into the
    /// ordinary register, never the record; a host proxy thread that sees the word change
    /// stores the record's send word, a release fence, then the doorbell again, so a doorbell
    /// the device lost is recovered from the record.
    NoDbrEmulated,
}

impl DoorbellMode {
    /// The number the exported descriptor carries (`QpDesc::db_mode`, `GPUVERBS_DB_*` in the
    /// device API); `Auto` is resolved to a GPU doorbell.
    pub const fn code(self) -> u32 {
        match self {
            Self::Auto | Self::GpuDoorbell => 0,
            Self::BlueFlame => 1,
            Self::CpuProxy => 2,
            Self::NoDbr => 3,
            Self::NoDbrEmulated => 4,
        }
    }

    /// Whether a host proxy thread keeps the QP's send doorbell record (and rings for it):
    /// the producer publishes its index in the CPU-proxy word.
    pub fn proxied(self) -> bool {
        matches!(self, Self::CpuProxy | Self::NoDbrEmulated)
    }

    /// Whether the device's register takes whole WQEs.
    pub fn is_blueflame(self) -> bool {
        self == Self::BlueFlame
    }
}
