//! Device counters: what the engine did, queryable at any time.
//!
//! The counters every WQE touches (WQEs, bytes, CQEs, doorbells) are sharded ([`Sharded`]): each
//! thread adds into a cache line of its own, a read sums the shards. So several engine threads
//! of one device do not bounce one cache line between their cores at every WQE.

use prm::Syndrome;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// A counter that can be added to and read.
pub(crate) trait Counter {
    fn add(&self, n: u64);
    fn get(&self) -> u64;
}

impl Counter for AtomicU64 {
    fn add(&self, n: u64) {
        self.fetch_add(n, Relaxed);
    }
    fn get(&self) -> u64 {
        self.load(Relaxed)
    }
}

/// Shards of a [`Sharded`] counter.
const SHARDS: usize = 16;

/// One shard on a cache line (and its neighbour, which adjacent-line prefetch pairs with it).
#[derive(Default)]
#[repr(align(128))]
struct Line(AtomicU64);

/// A counter split over cache lines: a thread adds into the shard of its own (threads are
/// given shards in turn), a read sums them all.
#[derive(Default)]
pub(crate) struct Sharded([Line; SHARDS]);

/// The calling thread's shard number (threads are numbered in turn, modulo 16): which shard of
/// a sharded counter, or copy of a replicated table, it uses.
pub(crate) fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Relaxed) % SHARDS;
    }
    MINE.with(|m| *m)
}

impl Counter for Sharded {
    fn add(&self, n: u64) {
        self.0[shard()].0.fetch_add(n, Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.iter().map(|l| l.0.load(Relaxed)).sum()
    }
}

/// Live counters of one device.
pub struct Counters {
    pub(crate) wqes: Sharded,
    pub(crate) bytes: Sharded,
    pub(crate) cqes: Sharded,
    pub(crate) doorbells: Sharded,
    pub(crate) doorbells_dropped: AtomicU64,
    pub(crate) bad_doorbells: AtomicU64,
    pub(crate) stale_wqes: AtomicU64,
    pub(crate) dc_key_violations: AtomicU64,
    pub(crate) xrc_bad_srq: AtomicU64,
    pub(crate) cq_overruns: AtomicU64,
    pub(crate) bf_torn: AtomicU64,
    pub(crate) bf_run: AtomicU64,
    pub(crate) devmem_errors: AtomicU64,
    pub(crate) staged_batches: AtomicU64,
    pub(crate) staged_wqes: AtomicU64,
    pub(crate) local_copy_batches: AtomicU64,
    pub(crate) local_copy_wqes: AtomicU64,
    pub(crate) carried_turns: AtomicU64,
    pub(crate) carry_calls: AtomicU64,
    pub(crate) answer_looks: AtomicU64,
    pub(crate) answers_found: AtomicU64,
    pub(crate) ud_qkey_drops: AtomicU64,
    pub(crate) ud_no_recv_drops: AtomicU64,
    pub(crate) ud_unready_drops: AtomicU64,
    pub(crate) ud_sent: AtomicU64,
    pub(crate) ud_received: AtomicU64,
    errors: [AtomicU64; 64],
    pub(crate) wire: WireCounters<AtomicU64>,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            wqes: Sharded::default(),
            bytes: Sharded::default(),
            cqes: Sharded::default(),
            doorbells: Sharded::default(),
            doorbells_dropped: AtomicU64::new(0),
            bad_doorbells: AtomicU64::new(0),
            stale_wqes: AtomicU64::new(0),
            dc_key_violations: AtomicU64::new(0),
            xrc_bad_srq: AtomicU64::new(0),
            cq_overruns: AtomicU64::new(0),
            bf_torn: AtomicU64::new(0),
            bf_run: AtomicU64::new(0),
            devmem_errors: AtomicU64::new(0),
            staged_batches: AtomicU64::new(0),
            staged_wqes: AtomicU64::new(0),
            local_copy_batches: AtomicU64::new(0),
            local_copy_wqes: AtomicU64::new(0),
            carried_turns: AtomicU64::new(0),
            carry_calls: AtomicU64::new(0),
            answer_looks: AtomicU64::new(0),
            answers_found: AtomicU64::new(0),
            ud_qkey_drops: AtomicU64::new(0),
            ud_no_recv_drops: AtomicU64::new(0),
            ud_unready_drops: AtomicU64::new(0),
            ud_sent: AtomicU64::new(0),
            ud_received: AtomicU64::new(0),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            wire: WireCounters::default(),
        }
    }
}

impl Counters {
    pub(crate) fn add(c: &impl Counter, n: u64) {
        c.add(n);
    }

    pub(crate) fn error(&self, s: Syndrome) {
        self.errors[s as usize & 63].fetch_add(1, Relaxed);
    }

    /// A consistent-enough copy of every counter.
    pub fn snapshot(&self) -> CounterSnapshot {
        let errors = Syndrome::ALL
            .into_iter()
            .filter_map(|s| {
                let n = self.errors[s as usize & 63].load(Relaxed);
                (n > 0).then_some((s, n))
            })
            .collect();
        CounterSnapshot {
            wqes_executed: self.wqes.get(),
            bytes_moved: self.bytes.get(),
            cqes_written: self.cqes.get(),
            doorbells_seen: self.doorbells.get(),
            doorbells_dropped: self.doorbells_dropped.load(Relaxed),
            bad_doorbells: self.bad_doorbells.load(Relaxed),
            stale_wqes: self.stale_wqes.load(Relaxed),
            dc_key_violations: self.dc_key_violations.load(Relaxed),
            xrc_bad_srq: self.xrc_bad_srq.load(Relaxed),
            cq_overruns: self.cq_overruns.load(Relaxed),
            bf_torn: self.bf_torn.load(Relaxed),
            bf_run: self.bf_run.load(Relaxed),
            device_memory_errors: self.devmem_errors.load(Relaxed),
            staged_batches: self.staged_batches.load(Relaxed),
            staged_wqes: self.staged_wqes.load(Relaxed),
            local_copy_batches: self.local_copy_batches.load(Relaxed),
            local_copy_wqes: self.local_copy_wqes.load(Relaxed),
            carried_turns: self.carried_turns.load(Relaxed),
            carry_calls: self.carry_calls.load(Relaxed),
            answer_looks: self.answer_looks.load(Relaxed),
            answers_found: self.answers_found.load(Relaxed),
            ud_qkey_drops: self.ud_qkey_drops.load(Relaxed),
            ud_no_recv_drops: self.ud_no_recv_drops.load(Relaxed),
            ud_unready_drops: self.ud_unready_drops.load(Relaxed),
            ud_sent: self.ud_sent.load(Relaxed),
            ud_received: self.ud_received.load(Relaxed),
            errors,
            wire: self.wire.load(),
        }
    }
}

/// A copy of a device's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// WQEs executed successfully.
    pub wqes_executed: u64,
    /// Payload bytes moved (writes, reads, sends, atomics).
    pub bytes_moved: u64,
    /// CQEs written (requester and responder, errors included).
    pub cqes_written: u64,
    /// Doorbell writes noticed.
    pub doorbells_seen: u64,
    /// Doorbells ignored by fault injection.
    pub doorbells_dropped: u64,
    /// Doorbells refused (wrong QPN, producer behind or too far ahead).
    pub bad_doorbells: u64,
    /// WQEs whose control-segment index did not match their ring position.
    pub stale_wqes: u64,
    /// Requests a DC target dropped for a wrong DC access key.
    pub dc_key_violations: u64,
    /// Requests an XRC target refused (NAK invalid request) for naming no XRC SRQ of its
    /// domain.
    pub xrc_bad_srq: u64,
    /// CQ overruns.
    pub cq_overruns: u64,
    /// BlueFlame register copies dropped because a later write to the half began while the
    /// engine copied it (the WQE then ran from the ring).
    pub bf_torn: u64,
    /// WQEs read from a BlueFlame register copy instead of the ring.
    pub bf_run: u64,
    /// Device-memory accesses (payload copies, ring reads, CQE writes) that failed.
    pub device_memory_errors: u64,
    /// Batched reads of the sources of several wire-bound WRITEs and SENDs in device memory
    /// (the WQE being run and those announced behind it; one wait per device memory).
    pub staged_batches: u64,
    /// WQEs whose sources those batches read.
    pub staged_wqes: u64,
    /// Settles of in-process WRITEs whose device-to-device copies were queued together (one
    /// wait per device memory for the batch, instead of one synchronous copy per WQE).
    pub local_copy_batches: u64,
    /// WQEs those settles completed.
    pub local_copy_wqes: u64,
    /// Turns of a program's thread ([`crate::Device::progress`]) that found work.
    pub carried_turns: u64,
    /// Turns a program's thread offered ([`crate::Device::progress`] calls), whether or not
    /// they found work: the device's own threads may have taken everything first.
    pub carry_calls: u64,
    /// Looks of the wire I/O thread for the doorbell that answers a datagram it delivered
    /// ([`crate::sched::AnswerWatch`]).
    pub answer_looks: u64,
    /// Those looks that found the answer rung (a doorbell seen since the delivery, by the
    /// look itself or by the engine).
    pub answers_found: u64,
    /// UD datagrams dropped at a receiving QP for a Q_Key that is not its own.
    pub ud_qkey_drops: u64,
    /// UD datagrams dropped because the receiving QP had no receive WQE posted (UD has no
    /// RNR).
    pub ud_no_recv_drops: u64,
    /// UD datagrams dropped because the receiving QP was not in RTR or RTS, or no UD QP has
    /// that number (in process; over the wire such datagrams count as `wire.rx_unknown_qp`).
    pub ud_unready_drops: u64,
    /// UD datagrams sent (in process or on the wire).
    pub ud_sent: u64,
    /// UD datagrams delivered into a receive WQE (error completions included).
    pub ud_received: u64,
    /// Error CQEs by syndrome (WR_FLUSH included).
    pub errors: BTreeMap<Syndrome, u64>,
    /// What the wire port did (all zero without one).
    pub wire: WireCounters,
}

impl CounterSnapshot {
    /// Error CQEs with syndrome `s`.
    pub fn errors_of(&self, s: Syndrome) -> u64 {
        self.errors.get(&s).copied().unwrap_or(0)
    }
}

macro_rules! wire_counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Counters of a device's wire port (RoCEv2 over UDP). Live counters are
        /// `WireCounters<AtomicU64>`; a snapshot is `WireCounters<u64>`.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct WireCounters<T = u64> {
            $($(#[$doc])* pub $name: T,)*
        }

        impl WireCounters<AtomicU64> {
            fn load(&self) -> WireCounters<u64> {
                WireCounters { $($name: self.$name.load(Relaxed),)* }
            }
        }
    };
}

wire_counters! {
    /// Datagrams sent (after fault injection: what reached the socket).
    tx_packets,
    /// Datagram bytes sent.
    tx_bytes,
    /// Datagrams received.
    rx_packets,
    /// Datagram bytes received.
    rx_bytes,
    /// Request packets sent again (go-back-N after a NAK, a timeout or a missing response;
    /// with selective repeat, the one packet a NAK names).
    retransmits,
    /// Expirations of a requester's retransmission timer.
    timeouts,
    /// Expirations of a requester's early (RTT-based) retransmission timer, which goes back
    /// N without counting a retry.
    early_timeouts,
    /// PSN sequence error NAKs sent (one per gap).
    seq_naks_sent,
    /// RNR NAKs sent.
    rnr_naks_sent,
    /// Error NAKs sent (invalid request, remote access, remote operational).
    error_naks_sent,
    /// PSN sequence error NAKs received.
    seq_naks_received,
    /// RNR NAKs received.
    rnr_naks_received,
    /// Duplicate requests received (re-acknowledged, reads re-executed, atomics answered
    /// from the responder's cache; never applied twice).
    duplicates,
    /// Requests that arrived with a PSN past the expected one: dropped (after the one NAK of
    /// the gap), or held until the gap is filled when the connection has selective repeat.
    out_of_sequence,
    /// Selective repeat: gaps filled while packets behind them were held.
    sr_gaps_filled,
    /// Selective repeat: held packets run once their gap was filled.
    sr_held_run,
    /// Selective repeat: gap reports sent (a responder names each gap behind the first one,
    /// and the rest of a first gap longer than one packet, as it opens).
    sr_gap_reports_sent,
    /// Selective repeat: gap reports received and acted on (their packets resent).
    sr_gap_reports_received,
    /// Selective repeat: gap reports received that named PSNs in flight but were not acted
    /// on: the packet behind the gap was never sent, or every PSN named was resent within the
    /// last round trip.
    sr_gap_reports_ignored,
    /// Selective repeat: held packets dropped unrun: one that did not fit the message in
    /// progress when its turn came (asked for again), or all of them when the responder's
    /// timer asked in vain for the gap in front of them.
    sr_held_dropped,
    /// Requests ahead of the expected PSN by the hold window or more (no requester has that
    /// much in flight), or, with selective repeat, from another UDP port than the
    /// requester's flow: not held; NAKed as go-back-N does (once per gap).
    out_of_window,
    /// Requests whose PSN was held with different bytes (forged or corrupted): neither copy
    /// runs, the requester sends that PSN again.
    rx_conflicting_duplicates,
    /// Datagrams dropped as malformed: truncated, oversized, unsupported opcode or version,
    /// payload longer than the path MTU, pad errors.
    rx_malformed,
    /// Datagrams dropped for a wrong ICRC.
    rx_bad_icrc,
    /// IPv4 datagrams dropped because they carried IP options or came in fragments (a RoCE
    /// NIC takes neither; seen where the kernel reports them, `IP_RECVOPTS` and
    /// `IP_RECVFRAGSIZE`).
    rx_not_plain_ip,
    /// Datagrams dropped for naming no QP of this device, or a QP not ready to take them.
    rx_unknown_qp,
    /// Responses dropped because they match nothing outstanding (late, duplicate or stray),
    /// ACKs and NAKs of PSNs never sent among them.
    rx_unexpected,
    /// UC request packets dropped: after a lost packet until the next first or only packet,
    /// or with a message the responder could not take (no receive, a bad key), as IBTA's UC
    /// responder drops them, answering nothing.
    uc_dropped,
    /// Datagrams dropped because their source IPv4 address is not the one of the QP's
    /// connected peer (its RTR `remote_gid`): requests and responses alike, with no effect on
    /// the QP.
    rx_wrong_source,
    /// Duplicate READ requests dropped because they match no READ the responder still holds
    /// (rkey, range or PSN window differ), with no effect on the QP.
    rx_bad_duplicate_reads,
    /// Socket send errors.
    tx_errors,
    /// Datagrams dropped by fault injection.
    injected_drops,
    /// Datagrams sent twice by fault injection.
    injected_duplicates,
    /// Datagrams held back behind the next one by fault injection.
    injected_reorders,
    /// Datagrams corrupted (one byte flipped) by fault injection.
    injected_corruptions,
}
