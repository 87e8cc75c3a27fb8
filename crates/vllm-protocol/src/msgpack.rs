//! A pull reader over one msgpack buffer: values are read in place, one at a time, so a list of
//! token ids becomes a `Vec<u32>` without a value tree in between (a tree costs 24–32 bytes per
//! id, and a hostile publisher chooses how many ids a batch declares). Lengths are checked
//! against the bytes left before anything is reserved, and nesting is bounded.

use rmp::Marker;

/// Why the buffer could not be read as msgpack.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("the data ends inside a value")]
    Truncated,
    #[error("a reserved msgpack marker (0xc1)")]
    Reserved,
    #[error("values nested deeper than {0}")]
    TooDeep(usize),
}

/// The kind of the next value, for readers that accept several.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// A position in a msgpack buffer.
#[derive(Clone, Copy, Debug)]
pub struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if self.rest.len() < n {
            return Err(ReadError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn be(&mut self, n: usize) -> Result<u64, ReadError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn marker(&self) -> Result<Marker, ReadError> {
        let byte = *self.rest.first().ok_or(ReadError::Truncated)?;
        match Marker::from_u8(byte) {
            Marker::Reserved => Err(ReadError::Reserved),
            m => Ok(m),
        }
    }

    /// The kind of the next value, without reading it.
    pub fn peek(&self) -> Result<Kind, ReadError> {
        Ok(match self.marker()? {
            Marker::Null => Kind::Nil,
            Marker::True | Marker::False => Kind::Bool,
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64 => Kind::Int,
            Marker::F32 | Marker::F64 => Kind::Float,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
            _ => Kind::Ext,
        })
    }

    /// An integer as a 64-bit pattern (negative ones as two's complement, as Python's ints
    /// taken modulo 2^64), and whether it was negative; None (nothing read) if the next value
    /// is no integer.
    pub fn int(&mut self) -> Result<Option<(u64, bool)>, ReadError> {
        let value = match self.marker()? {
            Marker::FixPos(n) => {
                self.take(1)?;
                (u64::from(n), false)
            }
            Marker::FixNeg(n) => {
                self.take(1)?;
                (i64::from(n) as u64, true)
            }
            Marker::U8 => (self.skip_marker().be(1)?, false),
            Marker::U16 => (self.skip_marker().be(2)?, false),
            Marker::U32 => (self.skip_marker().be(4)?, false),
            Marker::U64 => (self.skip_marker().be(8)?, false),
            Marker::I8 => signed(self.skip_marker().be(1)? as u8 as i8 as i64),
            Marker::I16 => signed(self.skip_marker().be(2)? as u16 as i16 as i64),
            Marker::I32 => signed(self.skip_marker().be(4)? as u32 as i32 as i64),
            Marker::I64 => signed(self.skip_marker().be(8)? as i64),
            _ => return Ok(None),
        };
        Ok(Some(value))
    }

    fn skip_marker(&mut self) -> &mut Self {
        self.rest = &self.rest[1..];
        self
    }

    /// A float (or an integer, as a float); None if the next value is neither.
    pub fn float(&mut self) -> Result<Option<f64>, ReadError> {
        match self.marker()? {
            Marker::F32 => Ok(Some(f64::from(f32::from_bits(
                self.skip_marker().be(4)? as u32
            )))),
            Marker::F64 => Ok(Some(f64::from_bits(self.skip_marker().be(8)?))),
            _ => Ok(self
                .int()?
                .map(|(v, negative)| if negative { v as i64 as f64 } else { v as f64 })),
        }
    }

    /// A string's bytes; None if the next value is no string.
    pub fn str(&mut self) -> Result<Option<&'a [u8]>, ReadError> {
        let len = match self.marker()? {
            Marker::FixStr(n) => {
                self.take(1)?;
                usize::from(n)
            }
            Marker::Str8 => self.skip_marker().be(1)? as usize,
            Marker::Str16 => self.skip_marker().be(2)? as usize,
            Marker::Str32 => self.skip_marker().be(4)? as usize,
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    /// A binary's bytes; None if the next value is no binary.
    pub fn bin(&mut self) -> Result<Option<&'a [u8]>, ReadError> {
        let len = match self.marker()? {
            Marker::Bin8 => self.skip_marker().be(1)? as usize,
            Marker::Bin16 => self.skip_marker().be(2)? as usize,
            Marker::Bin32 => self.skip_marker().be(4)? as usize,
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    /// An array's length; None if the next value is no array.
    pub fn array(&mut self) -> Result<Option<usize>, ReadError> {
        let len = match self.marker()? {
            Marker::FixArray(n) => {
                self.take(1)?;
                usize::from(n)
            }
            Marker::Array16 => self.skip_marker().be(2)? as usize,
            Marker::Array32 => self.skip_marker().be(4)? as usize,
            _ => return Ok(None),
        };
        // Every element takes a byte at least: a longer declaration is a lie.
        if len > self.rest.len() {
            return Err(ReadError::Truncated);
        }
        Ok(Some(len))
    }

    /// A map's number of pairs; None if the next value is no map.
    pub fn map(&mut self) -> Result<Option<usize>, ReadError> {
        let len = match self.marker()? {
            Marker::FixMap(n) => {
                self.take(1)?;
                usize::from(n)
            }
            Marker::Map16 => self.skip_marker().be(2)? as usize,
            Marker::Map32 => self.skip_marker().be(4)? as usize,
            _ => return Ok(None),
        };
        if len > self.rest.len() / 2 {
            return Err(ReadError::Truncated);
        }
        Ok(Some(len))
    }

    /// Whether the next value is nil (read if so).
    pub fn nil(&mut self) -> Result<bool, ReadError> {
        let is_nil = self.marker()? == Marker::Null;
        if is_nil {
            self.take(1)?;
        }
        Ok(is_nil)
    }

    /// Passes over the next value whatever it is, at most `depth` levels deep, allocating
    /// nothing.
    pub fn skip(&mut self, depth: usize) -> Result<(), ReadError> {
        // Values still to pass, at each open level (an explicit stack: no recursion to bound).
        let mut pending: Vec<usize> = vec![1];
        while let Some(left) = pending.last_mut() {
            if *left == 0 {
                pending.pop();
                continue;
            }
            *left -= 1;
            let children = match self.marker()? {
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                    self.array()?.unwrap_or(0)
                }
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => self.map()?.unwrap_or(0) * 2,
                m => {
                    self.skip_scalar(m)?;
                    continue;
                }
            };
            if pending.len() > depth {
                return Err(ReadError::TooDeep(depth));
            }
            pending.push(children);
        }
        Ok(())
    }

    fn skip_scalar(&mut self, marker: Marker) -> Result<(), ReadError> {
        self.take(1)?;
        let (fixed, len_bytes) = match marker {
            Marker::Null | Marker::True | Marker::False | Marker::FixPos(_) | Marker::FixNeg(_) => {
                (0, 0)
            }
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (usize::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (0, 1),
            Marker::Str16 | Marker::Bin16 => (0, 2),
            Marker::Str32 | Marker::Bin32 => (0, 4),
            Marker::FixExt1 => (2, 0),
            Marker::FixExt2 => (3, 0),
            Marker::FixExt4 => (5, 0),
            Marker::FixExt8 => (9, 0),
            Marker::FixExt16 => (17, 0),
            // Ext: the length, then the type byte, then the data.
            Marker::Ext8 => return self.skip_ext(1),
            Marker::Ext16 => return self.skip_ext(2),
            Marker::Ext32 => return self.skip_ext(4),
            _ => return Err(ReadError::Reserved),
        };
        let len = if len_bytes > 0 {
            self.be(len_bytes)? as usize
        } else {
            fixed
        };
        self.take(len).map(drop)
    }

    fn skip_ext(&mut self, len_bytes: usize) -> Result<(), ReadError> {
        let len = self.be(len_bytes)? as usize;
        self.take(1 + len).map(drop)
    }
}

fn signed(v: i64) -> (u64, bool) {
    (v as u64, v < 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn packed(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn scalars_read_as_written() {
        for (v, expected) in [
            (Value::from(5u8), (5, false)),
            (Value::from(300u16), (300, false)),
            (Value::from(u64::MAX), (u64::MAX, false)),
            (Value::from(-5i64), (-5i64 as u64, true)),
            (Value::from(-40_000i64), (-40_000i64 as u64, true)),
            (Value::from(i64::MIN), (i64::MIN as u64, true)),
        ] {
            let bytes = packed(&v);
            let mut c = Cursor::new(&bytes);
            assert_eq!(c.int().unwrap(), Some(expected), "{v}");
            assert_eq!(c.remaining(), 0, "{v}");
        }
        let bytes = packed(&Value::F64(1.5));
        assert_eq!(Cursor::new(&bytes).float().unwrap(), Some(1.5));
        let bytes = packed(&Value::from("hé"));
        assert_eq!(Cursor::new(&bytes).str().unwrap(), Some("hé".as_bytes()));
        let bytes = packed(&Value::Binary(vec![1, 2]));
        assert_eq!(Cursor::new(&bytes).bin().unwrap(), Some(&[1u8, 2][..]));
    }

    #[test]
    fn a_value_of_another_kind_is_left_unread() {
        let bytes = packed(&Value::from("x"));
        let mut c = Cursor::new(&bytes);
        assert_eq!(c.int().unwrap(), None);
        assert_eq!(c.array().unwrap(), None);
        assert_eq!(c.remaining(), bytes.len());
        assert_eq!(c.peek().unwrap(), Kind::Str);
    }

    #[test]
    fn skipping_passes_whole_values_and_bounds_depth() {
        let nested = Value::Array(vec![
            Value::Map(vec![(Value::from("k"), Value::Array(vec![Value::Nil; 3]))]),
            Value::Ext(3, vec![0; 20]),
            Value::F32(1.0),
            Value::Binary(vec![9; 300]),
        ]);
        let mut bytes = packed(&nested);
        bytes.push(0x07);
        let mut c = Cursor::new(&bytes);
        c.skip(4).unwrap();
        assert_eq!(c.int().unwrap(), Some((7, false)));
        let deep = (0..20).fold(Value::Nil, |v, _| Value::Array(vec![v]));
        let bytes = packed(&deep);
        assert_eq!(Cursor::new(&bytes).skip(16), Err(ReadError::TooDeep(16)));
    }

    #[test]
    fn declared_lengths_beyond_the_data_are_refused_before_reserving() {
        // An array32 declaring 2^32 - 1 elements in five bytes.
        let mut c = Cursor::new(b"\xdd\xff\xff\xff\xff");
        assert_eq!(c.array(), Err(ReadError::Truncated));
        let mut c = Cursor::new(b"\xdf\x00\x01\x00\x00\x01");
        assert_eq!(c.map(), Err(ReadError::Truncated));
        let mut c = Cursor::new(b"\xdb\x00\x00\x10\x00ab");
        assert_eq!(c.str(), Err(ReadError::Truncated));
    }

    proptest::proptest! {
        #[test]
        fn no_input_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let mut c = Cursor::new(&bytes);
            while c.remaining() > 0 && c.skip(16).is_ok() {}
        }
    }
}
