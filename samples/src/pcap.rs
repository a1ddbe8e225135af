//! `--pcap`: the capture of this side's soft NIC ([`Pcap`], [`start_pcap`]).

use crate::args::CommonArgs;
use anyhow::{bail, Context as _, Result};
use gpuverbs::Context;
use std::sync::Arc;

/// A capture of this side's soft NIC (`--pcap`), detached and flushed by [`Pcap::finish`] or
/// on drop (an early exit keeps what was captured).
pub struct Pcap {
    dev: Arc<gpuverbs::soft::Device>,
    writer: Arc<gpuverbs::soft::PcapWriter>,
    path: std::path::PathBuf,
}

/// Starts `--pcap` on the device of `ctx`: egress and ingress, the whole conversation.
pub fn start_pcap(a: &CommonArgs, ctx: &Context) -> Result<Option<Pcap>> {
    let Some(path) = &a.pcap else {
        return Ok(None);
    };
    let Some(dev) = ctx.soft_device() else {
        bail!(
            "--pcap needs the soft NIC (this run uses {})",
            ctx.selection().name
        );
    };
    let writer = gpuverbs::soft::PcapWriter::create(path)
        .with_context(|| format!("--pcap: create {}", path.display()))?;
    dev.set_capture(Some(gpuverbs::soft::Capture {
        writer: writer.clone(),
        ingress: true,
    }))
    .context("--pcap: the soft NIC has no wire port")?;
    Ok(Some(Pcap {
        dev: dev.clone(),
        writer,
        path: path.clone(),
    }))
}

impl Pcap {
    /// Stops capturing and writes the file out; says how many frames it holds (stderr).
    pub fn finish(self) -> Result<()> {
        let _ = self.dev.set_capture(None);
        self.writer
            .flush()
            .with_context(|| format!("--pcap: write {}", self.path.display()))?;
        eprintln!(
            "pcap: {} frames in {}",
            self.writer.packets(),
            self.path.display()
        );
        Ok(())
    }
}

impl Drop for Pcap {
    fn drop(&mut self) {
        let _ = self.dev.set_capture(None);
        let _ = self.writer.flush();
    }
}
