use std::fmt;

/// ONNX tensor element types, with their `TensorProto.DataType` codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum DType {
    F32 = 1,
    U8 = 2,
    I8 = 3,
    U16 = 4,
    I16 = 5,
    I32 = 6,
    I64 = 7,
    String = 8,
    Bool = 9,
    F16 = 10,
    F64 = 11,
    U32 = 12,
    U64 = 13,
    Complex64 = 14,
    Complex128 = 15,
    BF16 = 16,
    F8E4M3FN = 17,
    F8E4M3FNUZ = 18,
    F8E5M2 = 19,
    F8E5M2FNUZ = 20,
    U4 = 21,
    I4 = 22,
    F4E2M1 = 23,
    F8E8M0 = 24,
    U2 = 25,
    I2 = 26,
    F6E2M3 = 27,
    F6E3M2 = 28,
}

impl DType {
    pub const ALL: [DType; 28] = [
        DType::F32, DType::U8, DType::I8, DType::U16, DType::I16, DType::I32, DType::I64,
        DType::String, DType::Bool, DType::F16, DType::F64, DType::U32, DType::U64,
        DType::Complex64, DType::Complex128, DType::BF16, DType::F8E4M3FN, DType::F8E4M3FNUZ,
        DType::F8E5M2, DType::F8E5M2FNUZ, DType::U4, DType::I4, DType::F4E2M1, DType::F8E8M0,
        DType::U2, DType::I2, DType::F6E2M3, DType::F6E3M2,
    ];

    /// The type for an ONNX `TensorProto.DataType` code; `None` for 0 (UNDEFINED) and unknown codes.
    pub fn from_onnx(code: i32) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as i32 == code)
    }

    pub fn onnx_code(self) -> i32 {
        self as i32
    }

    /// Storage bits per element: 2, 4 and 6 for packed sub-byte types, 0 for strings.
    pub fn bits(self) -> usize {
        use DType::*;
        match self {
            U2 | I2 => 2,
            F6E2M3 | F6E3M2 => 6,
            U4 | I4 | F4E2M1 => 4,
            U8 | I8 | Bool | F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ | F8E8M0 => 8,
            U16 | I16 | F16 | BF16 => 16,
            F32 | I32 | U32 => 32,
            F64 | I64 | U64 | Complex64 => 64,
            Complex128 => 128,
            String => 0,
        }
    }

    /// Bytes needed to store `n` elements (sub-byte types are packed, low bits first).
    pub fn storage_bytes(self, n: u128) -> u128 {
        (n * self.bits() as u128).div_ceil(8)
    }

    pub fn is_float(self) -> bool {
        use DType::*;
        matches!(self, F32 | F16 | BF16 | F64 | F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ | F4E2M1 | F8E8M0 | F6E2M3 | F6E3M2)
    }

    pub fn is_integer(self) -> bool {
        use DType::*;
        matches!(self, U8 | I8 | U16 | I16 | I32 | I64 | U32 | U64 | U4 | I4 | U2 | I2)
    }

    pub fn is_signed(self) -> bool {
        use DType::*;
        matches!(self, I8 | I16 | I32 | I64 | I4 | I2) || self.is_float()
    }

    /// The inclusive value range of an integer type of at most 32 bits (`None` for other
    /// types).
    pub fn int_range(self) -> Option<(i64, i64)> {
        use DType::*;
        Some(match self {
            U8 => (0, 255),
            I8 => (-128, 127),
            U16 => (0, 65535),
            I16 => (-32768, 32767),
            U32 => (0, u32::MAX as i64),
            I32 => (i32::MIN as i64, i32::MAX as i64),
            U4 => (0, 15),
            I4 => (-8, 7),
            U2 => (0, 3),
            I2 => (-2, 1),
            _ => return None,
        })
    }

    /// The ONNX spelling of the type (`"float"`, `"int8"`, ...).
    pub fn onnx_name(self) -> &'static str {
        use DType::*;
        match self {
            F32 => "float",
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            I32 => "int32",
            I64 => "int64",
            String => "string",
            Bool => "bool",
            F16 => "float16",
            F64 => "double",
            U32 => "uint32",
            U64 => "uint64",
            Complex64 => "complex64",
            Complex128 => "complex128",
            BF16 => "bfloat16",
            F8E4M3FN => "float8e4m3fn",
            F8E4M3FNUZ => "float8e4m3fnuz",
            F8E5M2 => "float8e5m2",
            F8E5M2FNUZ => "float8e5m2fnuz",
            U4 => "uint4",
            I4 => "int4",
            F4E2M1 => "float4e2m1",
            F8E8M0 => "float8e8m0",
            U2 => "uint2",
            I2 => "int2",
            F6E2M3 => "float6e2m3",
            F6E3M2 => "float6e3m2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.onnx_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_onnx(d.onnx_code()), Some(d));
        }
        assert_eq!(DType::from_onnx(0), None);
        assert_eq!(DType::from_onnx(99), None);
    }

    #[test]
    fn packed_sizes() {
        assert_eq!(DType::I4.storage_bytes(5), 3);
        assert_eq!(DType::U2.storage_bytes(5), 2);
        assert_eq!(DType::F32.storage_bytes(5), 20);
    }
}
