//! The uverbs ioctl path (`RDMA_VERBS_IOCTL`): one call's header and attributes read from the
//! application, and the accessors a method uses, with the kernel's rules
//! (`core/uverbs_ioctl.c`): a header whose length does not match its attributes is EINVAL,
//! reserved header fields EPROTONOSUPPORT, an unknown attribute marked mandatory
//! EPROTONOSUPPORT, a missing required one EINVAL; values of at most 8 bytes travel inline in
//! `data`, larger ones behind a pointer; outputs are written to the application's buffer (at
//! most the room it gave) and flagged `VALID_OUTPUT`; a new object's handle is written back
//! into its attribute's `data`.

use crate::abi::{self, IoctlAttr, IoctlHdr};
use crate::uaccess::{copy_from_user, copy_to_user, Errno};

/// `UVERBS_ATTR_F_MANDATORY`.
const F_MANDATORY: u16 = 1;
/// Largest input copied from behind a pointer (a command mailbox is at most a few KiB).
const MAX_PTR_IN: usize = 1 << 16;

/// One ioctl call.
pub struct Call {
    /// The object (`UVERBS_OBJECT_*`, or a driver object from 0x1000).
    pub object: u16,
    /// The method of that object.
    pub method: u16,
    attrs: Vec<IoctlAttr>,
    /// Where the attribute array is in the application.
    uattrs: u64,
}

impl Call {
    /// Reads the header and attributes at `arg`.
    pub fn read(arg: u64) -> Result<Self, Errno> {
        let mut h = [0u8; 24];
        copy_from_user(arg, &mut h)?;
        let hdr: IoctlHdr = bytemuck::pod_read_unaligned(&h);
        let n = hdr.num_attrs as usize;
        if hdr.length as usize != 24 + 16 * n || hdr.length as usize > 4096 {
            return Err(Errno::EINVAL);
        }
        if hdr.reserved1 != 0 || hdr.reserved2 != 0 {
            return Err(Errno::EPROTONOSUPPORT);
        }
        let mut raw = vec![0u8; 16 * n];
        copy_from_user(arg + 24, &mut raw)?;
        let attrs: Vec<IoctlAttr> = raw
            .chunks_exact(16)
            .map(bytemuck::pod_read_unaligned)
            .collect();
        // an attribute given twice is refused (the kernel's bitmap of seen attributes)
        for (i, a) in attrs.iter().enumerate() {
            if attrs[..i].iter().any(|b| b.attr_id == a.attr_id) {
                return Err(Errno::EINVAL);
            }
        }
        Ok(Self {
            object: hdr.object_id,
            method: hdr.method_id,
            attrs,
            uattrs: arg + 24,
        })
    }

    /// The method accepts exactly the attributes `known`: any other one marked mandatory is
    /// EPROTONOSUPPORT (the kernel does not know it); others are ignored.
    pub fn only(&self, known: &[u16]) -> Result<(), Errno> {
        let unknown_mandatory = self
            .attrs
            .iter()
            .any(|a| !known.contains(&a.attr_id) && a.flags & F_MANDATORY != 0);
        if unknown_mandatory {
            return Err(Errno::EPROTONOSUPPORT);
        }
        Ok(())
    }

    fn find(&self, id: u16) -> Option<usize> {
        self.attrs.iter().position(|a| a.attr_id == id)
    }

    /// Whether attribute `id` was given.
    pub fn has(&self, id: u16) -> bool {
        self.find(id).is_some()
    }

    /// An inline input of at most 8 bytes (a value, a handle or an fd); `None` when absent.
    pub fn value(&self, id: u16) -> Result<Option<u64>, Errno> {
        let Some(i) = self.find(id) else {
            return Ok(None);
        };
        let a = self.attrs[i];
        if a.len > 8 || a.attr_data != 0 {
            return Err(Errno::EINVAL);
        }
        let keep = if a.len == 8 {
            u64::MAX
        } else {
            (1u64 << (8 * a.len)) - 1
        };
        Ok(Some(a.data & keep))
    }

    /// A required inline input.
    pub fn need(&self, id: u16) -> Result<u64, Errno> {
        self.value(id)?.ok_or(Errno::EINVAL)
    }

    /// A required object handle or fd (`data` as it is; such attributes carry no length).
    pub fn handle(&self, id: u16) -> Result<u32, Errno> {
        let a = self.attrs[self.find(id).ok_or(Errno::EINVAL)?];
        u32::try_from(a.data).map_err(|_| Errno::EINVAL)
    }

    /// A required input buffer (inline when at most 8 bytes, else behind the pointer).
    pub fn input(&self, id: u16) -> Result<Vec<u8>, Errno> {
        let a = self.attrs[self.find(id).ok_or(Errno::EINVAL)?];
        let len = a.len as usize;
        if a.attr_data != 0 || len > MAX_PTR_IN {
            return Err(Errno::EINVAL);
        }
        if len <= 8 {
            return Ok(a.data.to_ne_bytes()[..len].to_vec());
        }
        let mut v = vec![0u8; len];
        copy_from_user(a.data, &mut v)?;
        Ok(v)
    }

    /// The room the application gave a required output.
    pub fn out_len(&self, id: u16) -> Result<usize, Errno> {
        Ok(self.attrs[self.find(id).ok_or(Errno::EINVAL)?].len as usize)
    }

    /// Writes an output: at most the room given (the kernel's `uverbs_copy_to`), then flags
    /// the attribute `VALID_OUTPUT` in the application's copy.
    pub fn output(&self, id: u16, bytes: &[u8]) -> Result<(), Errno> {
        let i = self.find(id).ok_or(Errno::EINVAL)?;
        let a = self.attrs[i];
        let n = bytes.len().min(a.len as usize);
        copy_to_user(a.data, &bytes[..n])?;
        let flags = a.flags | abi::ioctl::ATTR_F_VALID_OUTPUT;
        copy_to_user(self.uattrs + 16 * i as u64 + 4, &flags.to_ne_bytes())
    }

    /// Writes an optional output when the application asked for it.
    pub fn output_if_asked(&self, id: u16, bytes: &[u8]) -> Result<(), Errno> {
        if self.has(id) {
            self.output(id, bytes)?;
        }
        Ok(())
    }

    /// Hands the handle of a new object back in attribute `id`'s `data`.
    pub fn new_handle(&self, id: u16, handle: u32) -> Result<(), Errno> {
        let i = self.find(id).ok_or(Errno::EINVAL)?;
        copy_to_user(
            self.uattrs + 16 * i as u64 + 8,
            &u64::from(handle).to_ne_bytes(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ioctl call laid out in this process's memory, as libibverbs builds one.
    struct Raw(Vec<u8>);

    fn attr(id: u16, len: u16, flags: u16, data: u64) -> [u8; 16] {
        let a = IoctlAttr {
            attr_id: id,
            len,
            flags,
            attr_data: 0,
            data,
        };
        bytemuck::cast(a)
    }

    fn call(attrs: &[[u8; 16]], tweak: impl FnOnce(&mut IoctlHdr)) -> Raw {
        let mut h = IoctlHdr {
            length: (24 + 16 * attrs.len()) as u16,
            object_id: 0x1000,
            method_id: 0x1000,
            num_attrs: attrs.len() as u16,
            reserved1: 0,
            driver_id: 1,
            reserved2: 0,
        };
        tweak(&mut h);
        let mut v = bytemuck::bytes_of(&h).to_vec();
        for a in attrs {
            v.extend_from_slice(a);
        }
        Raw(v)
    }

    impl Raw {
        fn read(&self) -> Result<Call, Errno> {
            Call::read(self.0.as_ptr() as u64)
        }
    }

    #[test]
    fn headers_that_do_not_add_up_are_refused() {
        let a = [attr(0x1000, 8, 1, 5)];
        assert_eq!(
            call(&a, |h| h.length += 16).read().err(),
            Some(Errno::EINVAL)
        );
        assert_eq!(
            call(&a, |h| h.reserved1 = 1).read().err(),
            Some(Errno::EPROTONOSUPPORT)
        );
        assert_eq!(
            call(&a, |h| h.reserved2 = 1).read().err(),
            Some(Errno::EPROTONOSUPPORT)
        );
        let twice = [attr(0x1000, 8, 1, 5), attr(0x1000, 8, 1, 6)];
        assert_eq!(call(&twice, |_| ()).read().err(), Some(Errno::EINVAL));
    }

    #[test]
    fn unknown_attributes_fail_only_when_mandatory() {
        let c = call(&[attr(0x1000, 4, 1, 7), attr(0x1777, 4, 0, 0)], |_| ())
            .read()
            .unwrap();
        assert!(c.only(&[0x1000]).is_ok());
        let c = call(&[attr(0x1000, 4, 1, 7), attr(0x1777, 4, 1, 0)], |_| ())
            .read()
            .unwrap();
        assert_eq!(c.only(&[0x1000]), Err(Errno::EPROTONOSUPPORT));
    }

    #[test]
    fn inline_values_keep_their_length_and_pointers_are_read() {
        let mailbox = [0xabu8; 32];
        let c = call(
            &[
                attr(0x1000, 4, 1, 0xdead_beef_0000_0007),
                attr(0x1001, 32, 1, mailbox.as_ptr() as u64),
                attr(0x1002, 0, 1, 42),
            ],
            |_| (),
        )
        .read()
        .unwrap();
        assert_eq!(c.need(0x1000), Ok(7));
        assert_eq!(c.input(0x1001).unwrap(), mailbox.to_vec());
        assert_eq!(c.handle(0x1002), Ok(42));
        assert_eq!(c.need(0x1003), Err(Errno::EINVAL));
        // a value that does not fit inline is not a value
        assert_eq!(c.value(0x1001), Err(Errno::EINVAL));
    }

    #[test]
    fn outputs_fit_the_room_given_and_are_flagged() {
        let mut out = [0u8; 4];
        let raw = call(
            &[
                attr(0x1001, 4, 1, out.as_mut_ptr() as u64),
                attr(0x1000, 0, 1, 0),
            ],
            |_| (),
        );
        let c = raw.read().unwrap();
        c.output(0x1001, &[1, 2, 3, 4, 5, 6]).unwrap();
        c.new_handle(0x1000, 99).unwrap();
        // (both buffers' addresses went to the kernel, which wrote them)
        let raw = std::hint::black_box(&raw.0);
        assert_eq!(std::hint::black_box(out), [1, 2, 3, 4]);
        let first: IoctlAttr = bytemuck::pod_read_unaligned(&raw[24..40]);
        assert_eq!(first.flags, 1 | abi::ioctl::ATTR_F_VALID_OUTPUT);
        let second: IoctlAttr = bytemuck::pod_read_unaligned(&raw[40..56]);
        assert_eq!(second.data, 99);
    }
}
