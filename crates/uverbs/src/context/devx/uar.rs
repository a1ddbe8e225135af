//! UAR pages allocated on demand (the UAR object's ALLOC / DESTROY): BlueFlame or non-cached
//! doorbell pages, each mapped by the application at its own mmap offset, named by a page id
//! in CQ and QP contexts. libmlx5 allocates one NC page when it opens a context in
//! dynamic-UAR mode (CQ arm doorbells and QPs without BlueFlame) and BF pages for its QPs;
//! DEVX users allocate them through `mlx5dv_devx_alloc_uar`.

use crate::abi::mlx5_ioctl::uar as a;
use crate::context::{uar, Context, DynUar};
use crate::ioctl::Call;
use crate::uaccess::Errno;
use prm::doorbell::UAR_PAGE_SIZE;

/// Page ids stay below 2^16: libmlx5 passes a CQ's page id in a 16-bit field.
const MAX_PAGE_ID: u32 = 0xffff;

impl Context {
    /// UAR ALLOC.
    pub(in crate::context) fn uar_alloc(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[
            a::HANDLE,
            a::TYPE,
            a::MMAP_OFFSET,
            a::MMAP_LENGTH,
            a::PAGE_ID,
        ])?;
        let bf = match call.need(a::TYPE)? {
            a::TYPE_BF => true,
            a::TYPE_NC => false,
            _ => return Err(Errno::EOPNOTSUPP),
        };
        let mut o = self.objs.lock();
        if o.last_page_id >= MAX_PAGE_ID {
            return Err(Errno::ENOMEM);
        }
        let (page_id, entry) = (o.last_page_id + 1, o.last_entry + 1);
        let u = DynUar::new(page_id, bf, entry)?;
        let h = o.handle();
        let offset = uar::dyn_mmap_pgoff(entry) * UAR_PAGE_SIZE as u64;
        call.output(a::MMAP_OFFSET, &offset.to_ne_bytes())?;
        call.output(a::MMAP_LENGTH, &(UAR_PAGE_SIZE as u32).to_ne_bytes())?;
        call.output(a::PAGE_ID, &page_id.to_ne_bytes())?;
        call.new_handle(a::HANDLE, h)?;
        o.last_page_id = page_id;
        o.last_entry = entry;
        o.dyn_uars.insert(h, u);
        Ok(())
    }

    /// UAR DESTROY: refused (EBUSY) while a CQ or QP rings doorbells on the page.
    pub(in crate::context) fn uar_destroy(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[a::HANDLE])?;
        let h = call.handle(a::HANDLE)?;
        let mut o = self.objs.lock();
        let page_id = o.dyn_uars.get(&h).ok_or(Errno::EINVAL)?.page_id;
        if o.uar_in_use(page_id) {
            return Err(Errno::EBUSY);
        }
        o.dyn_uars.remove(&h);
        Ok(())
    }
}
