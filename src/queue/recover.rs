//! Bringing an RC QP back after an error ([`Qp::recover`]): drained through its CQs, reset,
//! a fresh PSN; [`Qp::connect`] then takes it to RTS against the peer's new endpoint.

use super::qp::Qp;
use crate::Error;
use prm::Completion;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use verbs::initiator::RingMode;
use verbs::{Modify, QpState};

/// The completions [`Qp::recover`] took from the QP's CQs while draining it: every WQE that
/// was outstanding (posted and not yet completed to a poster) completes exactly once, most of
/// them with a flush error ([`prm::Syndrome::WrFlush`]); a completion the device wrote before
/// the error and nobody took is here too, in the order the device wrote them.
#[derive(Clone, Debug, Default)]
pub struct Drained {
    /// Requester completions (send queue).
    pub send: Vec<Completion>,
    /// Responder completions (receive queue).
    pub recv: Vec<Completion>,
}

impl Drained {
    /// Completions that are errors, of both queues.
    pub fn errors(&self) -> impl Iterator<Item = &prm::ErrorCqe> {
        self.send.iter().chain(&self.recv).filter_map(|c| match c {
            Completion::Error(e) => Some(e),
            _ => None,
        })
    }
}

impl Qp {
    /// Brings the QP back after an error (or takes a working one down to start again):
    ///
    /// 1. unless it is in RESET or ERR, it is moved to ERR, so the device completes every
    ///    outstanding WQE — send and receive — with a flush error;
    /// 2. those completions (and any the device wrote before and nobody took) are taken from
    ///    its CQs and returned, waiting at most `timeout` for the device to complete every WQE
    ///    posted ([`Error::Drain`] when it has not, and the QP stays in ERR);
    /// 3. the QP moves to RESET (indexes 0, doorbell record and CPU-proxy word cleared) with a
    ///    new random PSN.
    ///
    /// Then [`Qp::endpoint`] carries the new PSN: the peers exchange endpoints again (the peer
    /// recovers its QP, or is a new QP of a restarted process) and [`Qp::connect`] takes the
    /// QP to RTS. A GPU export made after that starts on the fresh queues.
    ///
    /// The QP must have no poster (drop the CPU initiator, the GPU export and the CPU-proxy
    /// target first: [`Error::PosterBusy`]; `ExportedQp::recover` recovers an exported QP
    /// keeping its descriptor, whose tracking then starts clean), its rings and its CQs'
    /// rings in host memory (the CPU polls the CQs: [`Error::InvalidArgument`] for rings in
    /// GPU memory, whose QPs a kernel drains — it sees every flush as an `ERROR_CQE` —
    /// before [`Qp::modify`] to RESET), and no one else may poll its CQs meanwhile (as for
    /// any poster). On the mlx5
    /// backend a QP whose receives share its send CQ must have taken every receive
    /// completion before (`InvalidArgument` otherwise: the provider's rings cannot say how
    /// many were consumed).
    pub fn recover(&self, timeout: Duration) -> Result<Drained, Error> {
        let start = Instant::now();
        let mut ini = self.try_cpu_initiator(RingMode::RdmaCore)?;
        if !matches!(self.state(), QpState::Reset | QpState::Err) {
            self.modify(Modify::Err)?;
        }
        let shared = self.send_cq().cqn() == self.recv_cq().cqn();
        let mut receives = ini.recv_outstanding();
        let mut out = Drained::default();
        loop {
            // a shared CQ holds both queues' completions: one poller takes them all
            while let Some(c) = ini.poll_send() {
                match c {
                    Completion::Resp { .. }
                    | Completion::Error(prm::ErrorCqe {
                        responder: true, ..
                    }) => {
                        receives = receives.saturating_sub(1);
                        out.recv.push(c);
                    }
                    c => out.send.push(c),
                }
            }
            if !shared {
                while let Some(c) = ini.poll_recv() {
                    out.recv.push(c);
                }
                receives = ini.recv_outstanding();
            }
            if ini.outstanding() == 0 && receives == 0 {
                break;
            }
            let overrun = ini.cq_overrun(false) || ini.cq_overrun(true);
            if start.elapsed() >= timeout || overrun {
                return Err(Error::Drain {
                    qpn: self.qpn(),
                    waited: start.elapsed(),
                    send_blocks: ini.outstanding(),
                    receives,
                    overrun,
                });
            }
            ini.idle_until_completion(!shared && ini.outstanding() == 0, Duration::from_millis(1));
        }
        // RESET while the initiator still holds the QP: no poster can slip in between
        self.modify(Modify::Reset)?;
        self.psn
            .store(crate::Endpoint::random_psn(), Ordering::Release);
        drop(ini);
        tracing::debug!(
            qpn = self.qpn(),
            send = out.send.len(),
            recv = out.recv.len(),
            psn = self.psn(),
            "QP recovered to RESET"
        );
        Ok(out)
    }
}
