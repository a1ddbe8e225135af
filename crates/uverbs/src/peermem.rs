//! GPU memory an application registers, with REG_MR on a GPU address (what nvidia-peermem lets
//! the kernel resolve on a host with a ConnectX) or with REG_DMABUF_MR on a dma-buf of it. The emulated kernel lives in the application's process,
//! so it asks CUDA there whether the range is device memory of one allocation
//! ([`softnic_cuda::device_allocation`]) and moves its bytes with CUDA copies (one
//! [`softnic_cuda::CudaMemory`] per GPU, made on first use). Without a CUDA driver, or for an
//! address CUDA does not know, the range is simply not memory (EFAULT), as without peermem.

use parking_lot::Mutex;
use std::sync::Arc;
use verbs::DeviceMemory;

/// The device memory behind `addr..addr+len`, when it is one allocation of GPU memory.
pub fn resolve(addr: u64, len: u64) -> Option<Arc<dyn DeviceMemory>> {
    let a = softnic_cuda::device_allocation(addr)?;
    if !a.covers(addr, len) {
        return None;
    }
    memory_of(a.ordinal)
}

/// The copies of GPU `ordinal` (its primary context), made once.
fn memory_of(ordinal: usize) -> Option<Arc<dyn DeviceMemory>> {
    static BY_GPU: Mutex<Vec<(usize, Arc<dyn DeviceMemory>)>> = Mutex::new(Vec::new());
    let mut all = BY_GPU.lock();
    if let Some((_, m)) = all.iter().find(|(o, _)| *o == ordinal) {
        return Some(m.clone());
    }
    let made = softnic_cuda::catch_panic(|| {
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| e.to_string())?;
        softnic_cuda::CudaMemory::new(&ctx).map_err(|e| e.to_string())
    });
    match made {
        Ok(Ok(m)) => {
            let m: Arc<dyn DeviceMemory> = Arc::new(m);
            all.push((ordinal, m.clone()));
            Some(m)
        }
        Ok(Err(e)) | Err(e) => {
            crate::complain(format_args!("REG_MR of GPU {ordinal} memory: {e}"));
            None
        }
    }
}
