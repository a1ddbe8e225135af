//! Completion channels and CQs: CREATE_COMP_CHANNEL, CREATE_CQ, EX_CREATE_CQ, RESIZE_CQ and
//! DESTROY_CQ, and the CQ object the emulation's arm-doorbell watcher reads.

use super::{unsupported, user_buf, Context, Created, Io};
use crate::abi;
use crate::device::MAX_CQE;
use crate::events::EventQueue;
use crate::uaccess::Errno;
use parking_lot::Mutex;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use verbs::DmaBuf;

/// Arming state of a CQ, as its doorbells left it.
#[derive(Default)]
pub struct Arm {
    pub armed: bool,
    pub ci: u32,
    /// The last arm word seen in the CQ's doorbell record.
    pub last_word: u32,
    /// The producer index (24 bits) when the CQ's last event was generated: the CQEs before it
    /// have had their event.
    pub reported: u32,
    /// Set when the CQ is destroyed (or its context torn down), under this lock: the event
    /// watcher, which reads and writes the application's doorbell record holding it, leaves
    /// the CQ alone from then on, so the provider may free the record once DESTROY_CQ
    /// returns.
    pub destroyed: bool,
}

impl CqObj {
    /// Stops the event watcher's use of the CQ's doorbell record (it holds the arm lock while
    /// it reads or writes it): called once the CQ is destroyed.
    pub fn retire(&self) {
        self.arm.lock().destroyed = true;
    }
}

impl Arm {
    /// Whether an armed CQ whose producer index is `produced` (24 bits) has its event due: a
    /// CQE past both the consumer index of the arm and the CQEs that already had an event.
    /// So a program that polls until empty and then arms learns of a CQE that came between
    /// the two, and one that arms before it polls (the verbs pattern: get the event, ack, arm,
    /// poll) is not woken again for the CQE it is about to poll.
    pub fn due(&self, produced: u32) -> bool {
        const MASK: u32 = 0xff_ffff;
        // a distance of 2^23 or more is behind, not ahead
        let ahead = |d: u32| d & MASK < 1 << 23;
        let start = if ahead(self.reported.wrapping_sub(self.ci)) {
            self.reported
        } else {
            self.ci
        };
        let d = produced.wrapping_sub(start) & MASK;
        d != 0 && ahead(d)
    }
}

/// A CQ.
pub struct CqObj {
    pub soft: Arc<softnic::Cq>,
    pub user_handle: u64,
    pub channel: Option<Arc<EventQueue>>,
    pub comp_reported: Arc<AtomicU32>,
    /// Async events read for this CQ (DESTROY_CQ's `async_events_reported`).
    pub async_reported: Arc<AtomicU32>,
    /// The CQ doorbell record (consumer index, arm word), the application's.
    pub dbrec: DmaBuf,
    pub arm: Mutex<Arm>,
    /// An identity for events (unique per process).
    pub key: u64,
    /// The UAR page its arm doorbells go to (offset [`super::CQ_DOORBELL`]): static page 0,
    /// or the page the library named (dynamic-UAR mode).
    pub arm_page: Option<Arc<DmaBuf>>,
    /// That page's id when it is a dynamically allocated one.
    pub uar_page: Option<u32>,
}

/// `MLX5_IB_CREATE_CQ_FLAGS_CQE_128B_PAD`: 128-byte CQEs padded (needs `cqe_128_always`).
const CQ_FLAG_CQE_128B_PAD: u16 = 1 << 0;
/// `MLX5_IB_CREATE_CQ_FLAGS_UAR_PAGE_INDEX`: `uar_page_index` names the CQ's UAR page.
const CQ_FLAG_UAR_PAGE_INDEX: u16 = 1 << 1;

/// The CQE size in the driver data of CREATE_CQ and RESIZE_CQ: 64 or 128 bytes (mlx5_ib:
/// anything else is EINVAL). A CQ of 128-byte CQEs has its CQE in each entry's second half;
/// the first half is where a ConnectX scatters small received data when the QP asked for
/// scatter-to-CQE (`MLX5_QP_FLAG_SCATTER_CQE`), which the soft NIC does not do: it writes the
/// data into the receive buffer and leaves the CQE's inline-scatter bits clear, which the
/// provider (and UCX) read as "data in the buffer".
fn cqe_size(bytes: u32) -> Result<verbs::CqeSize, Errno> {
    verbs::CqeSize::from_bytes(bytes).ok_or(Errno::EINVAL)
}

impl Context {
    /// CREATE_CQ (the legacy command).
    pub(super) fn legacy_create_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateCq = io.core()?;
        self.create_cq(
            io,
            r.user_handle,
            r.cqe,
            r.comp_vector,
            r.comp_channel,
            false,
        )
    }

    /// EX_CREATE_CQ.
    pub(super) fn ex_create_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ExCreateCq = io.core()?;
        if r.comp_mask != 0 || r.flags & !1 != 0 {
            // only IB_UVERBS_CQ_FLAGS_TIMESTAMP_COMPLETION is known (every CQE of the soft
            // NIC carries its timestamp, so the flag asks for nothing more)
            return Err(Errno::EOPNOTSUPP);
        }
        self.create_cq(
            io,
            r.user_handle,
            r.cqe,
            r.comp_vector,
            r.comp_channel,
            true,
        )
    }

    pub(super) fn create_comp_channel(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let q = EventQueue::new(8)?;
        io.reply(&abi::CompChannelResp { fd: q.fd() as u32 })?;
        self.objs.lock().channels.insert(q.fd(), q.clone());
        Ok(Created::Channel(q))
    }

    /// Forgets a completion channel the application closed.
    pub fn close_channel(&self, fd: RawFd) {
        self.objs.lock().channels.remove(&fd);
    }

    fn create_cq(
        &self,
        io: &Io<'_>,
        user_handle: u64,
        cqe: u32,
        comp_vector: u32,
        channel: i32,
        ex: bool,
    ) -> Result<Created, Errno> {
        let u: abi::Mlx5CreateCq = io.udata()?;
        if io.udata.len() < 24 {
            return Err(Errno::EINVAL);
        }
        if cqe == 0 || cqe > MAX_CQE || comp_vector != 0 {
            return Err(Errno::EINVAL);
        }
        // mlx5_ib's order: unknown flags, the CQE size and reserved fields (EINVAL), then
        // compression and padding, which need device capabilities this one lacks
        if u.flags & !(CQ_FLAG_UAR_PAGE_INDEX | CQ_FLAG_CQE_128B_PAD) != 0 {
            return Err(Errno::EINVAL);
        }
        let size = cqe_size(u.cqe_size)?;
        if u.reserved0 != 0 || u.reserved1 != 0 {
            return Err(Errno::EINVAL);
        }
        if u.cqe_comp_en == 1 {
            return Err(unsupported("CQE compression"));
        }
        if u.flags & CQ_FLAG_CQE_128B_PAD != 0 {
            // cqe_128_always is 0: mlx5_ib refuses padding for any CQE size
            return Err(unsupported("128-byte CQE padding"));
        }
        let ncqe = (cqe + 1).next_power_of_two();
        let ring = user_buf(u.buf_addr, ncqe as usize * size.bytes())?;
        let dbrec = user_buf(u.db_addr, 8)?;
        let arm_view = user_buf(u.db_addr, 8)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        // dynamic-UAR mode: the library names the page (mlx5_ib: EINVAL without it)
        let (arm_page, uar_page) = match (o.dynamic_uars, u.flags & CQ_FLAG_UAR_PAGE_INDEX != 0) {
            (true, false) => return Err(Errno::EINVAL),
            (_, true) => {
                let id = u32::from(u.uar_page_index);
                (
                    Some(self.uar_page(&o, id).ok_or(Errno::EINVAL)?.0),
                    Some(id),
                )
            }
            (false, false) => (self.uars.lock().as_ref().and_then(|u| u.page0()), None),
        };
        let channel = match channel {
            -1 => None,
            fd => Some(o.channels.get(&fd).cloned().ok_or(Errno::EINVAL)?),
        };
        let scq = soft
            .create_cq(softnic::CqConfig {
                ncqe,
                mode: verbs::CqMode::OverrunDetect,
                init: verbs::CqInit::Invalid,
                ring: Some(ring),
                dbrec: Some(dbrec),
                cqe_size: size,
            })
            .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let reply = if ex {
            io.reply(&abi::ExCreateCqResp {
                cq_handle: h,
                cqe: ncqe - 1,
                comp_mask: 0,
                response_length: 16,
            })
        } else {
            io.reply(&abi::CreateCqResp {
                cq_handle: h,
                cqe: ncqe - 1,
            })
        };
        if let Err(e) = reply.and_then(|_| {
            io.ureply(&abi::Mlx5CreateCqResp {
                cqn: scq.cqn(),
                reserved: 0,
            })
        }) {
            let _ = soft.destroy_cq(&scq);
            return Err(e);
        }
        let async_reported: Arc<AtomicU32> = Arc::default();
        let key = crate::next_key();
        scq.set_event_handler(Some(self.event_handler(
            user_handle,
            key,
            async_reported.clone(),
        )));
        let obj = Arc::new(CqObj {
            soft: scq,
            user_handle,
            channel,
            comp_reported: Arc::default(),
            async_reported,
            dbrec: arm_view,
            arm: Mutex::new(Arm::default()),
            key,
            arm_page,
            uar_page: uar_page.filter(|_| o.dynamic_uars),
        });
        o.cqs.insert(h, obj.clone());
        Ok(Created::Cq(obj))
    }

    pub(super) fn destroy_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let cq = o.cqs.get(&r.handle).ok_or(Errno::EINVAL)?.clone();
        // in use by a QP, a DEVX object, or an XRC SRQ (whose receives complete there)
        let xrc_srq = o
            .srqs
            .values()
            .any(|s| s.xrc.is_some_and(|(_, c)| c == r.handle));
        if o.cq_in_use(cq.soft.cqn()) || xrc_srq {
            return Err(Errno::EBUSY);
        }
        soft.destroy_cq(&cq.soft).map_err(|_| Errno::EBUSY)?;
        cq.retire();
        o.cqs.remove(&r.handle);
        cq.soft.set_event_handler(None);
        if let Some(ch) = &cq.channel {
            ch.purge(cq.key);
        }
        self.purge_async(cq.key);
        io.reply(&abi::DestroyCqResp {
            comp_events_reported: cq.comp_reported.load(Ordering::Acquire),
            async_events_reported: cq.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }

    pub(super) fn resize_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ResizeCq = io.core()?;
        let u: abi::Mlx5ResizeCq = io.udata()?;
        if io.udata.len() < std::mem::size_of::<abi::Mlx5ResizeCq>() {
            return Err(Errno::EINVAL);
        }
        if u.reserved0 != 0 || u.reserved1 != 0 {
            return Err(Errno::EINVAL);
        }
        let size = cqe_size(u.cqe_size.into())?;
        if r.cqe < 1 || r.cqe > MAX_CQE {
            return Err(Errno::EINVAL);
        }
        let cq = self
            .objs
            .lock()
            .cqs
            .get(&r.cq_handle)
            .cloned()
            .ok_or(Errno::EINVAL)?;
        let ncqe = (r.cqe + 1).next_power_of_two();
        if ncqe != cq.soft.ncqe() {
            let ring = user_buf(u.buf_addr, ncqe as usize * size.bytes())?;
            cq.soft
                .resize_sized(ncqe, ring, size)
                .map_err(|_| Errno::EINVAL)?;
        }
        io.reply(&abi::ResizeCqResp {
            cqe: cq.soft.ncqe() - 1,
            reserved: 0,
        })?;
        Ok(Created::Nothing)
    }
}

#[cfg(test)]
mod tests {
    use super::Arm;

    fn arm(ci: u32, reported: u32) -> Arm {
        Arm {
            armed: true,
            ci,
            last_word: 0,
            reported,
            destroyed: false,
        }
    }

    #[test]
    fn an_arm_is_due_for_cqes_past_its_consumer_index_that_had_no_event() {
        // fresh CQ: the first CQE
        assert!(!arm(0, 0).due(0));
        assert!(arm(0, 0).due(1));
        // get event (CQE 0 reported), ack, arm before polling (ci 0): not again for CQE 0 ...
        assert!(!arm(0, 1).due(1));
        // ... but for the next one
        assert!(arm(0, 1).due(2));
        // polled until empty (ci 5), a CQE came before the arm: due at once
        assert!(arm(5, 3).due(6));
        assert!(!arm(5, 3).due(5));
        // across the 24-bit wrap
        assert!(arm(0xff_fffe, 0xff_ffff).due(0));
        assert!(!arm(0xff_fffe, 0).due(0));
        // an event long ago (reported far behind ci) does not hide a new CQE
        assert!(arm(0x90_0000, 0x10_0000).due(0x90_0001));
    }
}
