//! (being written)
pub fn setup_cuda() -> anyhow::Result<()> { anyhow::bail!("todo") }
