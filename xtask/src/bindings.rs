//! (being written)
pub fn run(_c: bool) -> anyhow::Result<()> { anyhow::bail!("todo") }
