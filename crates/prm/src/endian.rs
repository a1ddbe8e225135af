//! Big-endian newtypes. Each stores the bytes as they sit in memory, so a value can only be
//! read or written through [`Be32::get`]/[`Be32::new`] and friends; there is no way to store a
//! host-order integer by accident.

use bytemuck::{Pod, Zeroable};

macro_rules! be_type {
    ($(#[$m:meta])* $name:ident, $int:ty, $n:expr) => {
        $(#[$m])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
        #[repr(transparent)]
        pub struct $name([u8; $n]);

        impl $name {
            /// Stores `v` in big-endian order.
            pub const fn new(v: $int) -> Self {
                Self(v.to_be_bytes())
            }
            /// Reads the value in host order.
            pub const fn get(self) -> $int {
                <$int>::from_be_bytes(self.0)
            }
            /// The raw bytes as they are in memory.
            pub const fn to_bytes(self) -> [u8; $n] {
                self.0
            }
            /// From raw memory bytes (no byte swap).
            pub const fn from_bytes(b: [u8; $n]) -> Self {
                Self(b)
            }
        }

        impl core::fmt::Debug for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.get())
            }
        }
    };
}

be_type!(
    /// A big-endian `u16`.
    Be16, u16, 2
);
be_type!(
    /// A big-endian `u32`.
    Be32, u32, 4
);
be_type!(
    /// A big-endian `u64`.
    Be64, u64, 8
);

/// A local key in host order, as returned by memory registration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Lkey(pub u32);

/// A remote key in host order: a capability to access a registered region from a peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Rkey(pub u32);

macro_rules! be_key {
    ($(#[$m:meta])* $name:ident, $key:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
        #[repr(transparent)]
        pub struct $name([u8; 4]);

        impl $name {
            /// Stores the key big-endian.
            pub const fn new(k: $key) -> Self {
                Self(k.0.to_be_bytes())
            }
            /// The key in host order.
            pub const fn get(self) -> $key {
                $key(u32::from_be_bytes(self.0))
            }
        }

        impl From<$key> for $name {
            fn from(k: $key) -> Self {
                Self::new(k)
            }
        }

        impl core::fmt::Debug for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.get().0)
            }
        }
    };
}

be_key!(
    /// An lkey as stored in a data segment (big-endian).
    BeLkey, Lkey
);
be_key!(
    /// An rkey as stored in a remote-address segment (big-endian).
    BeRkey, Rkey
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_big_endian() {
        assert_eq!(Be32::new(0x0102_0304).to_bytes(), [1, 2, 3, 4]);
        assert_eq!(Be16::new(0x0a0b).to_bytes(), [0x0a, 0x0b]);
        assert_eq!(Be64::new(1).to_bytes(), [0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(Be32::from_bytes([0, 0, 1, 0]).get(), 256);
        assert_eq!(BeRkey::new(Rkey(0x11223344)).get(), Rkey(0x11223344));
        assert_eq!(
            bytemuck::bytes_of(&BeLkey::new(Lkey(0xaabbccdd))),
            &[0xaa, 0xbb, 0xcc, 0xdd]
        );
    }
}
