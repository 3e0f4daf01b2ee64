//! Tensor element/block types, numbered exactly as ggml numbers them (`enum ggml_type`), with
//! ggml's block sizes (elements per block) and type sizes (bytes per block).
//!
//! Types we can name but not compute with (the IQ* family, TQ*) are listed so that a file
//! holding them can still be read and inspected; using one in a forward gives
//! [`crate::Error::UnsupportedType`].

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

use GgmlType::*;

/// (type, ggml id, elements per block, bytes per block, name as ggml prints it)
const TABLE: &[(GgmlType, u32, usize, usize, &str)] = &[
    (F32, 0, 1, 4, "F32"),
    (F16, 1, 1, 2, "F16"),
    (Q4_0, 2, 32, 18, "Q4_0"),
    (Q4_1, 3, 32, 20, "Q4_1"),
    (Q5_0, 6, 32, 22, "Q5_0"),
    (Q5_1, 7, 32, 24, "Q5_1"),
    (Q8_0, 8, 32, 34, "Q8_0"),
    (Q8_1, 9, 32, 36, "Q8_1"),
    (Q2_K, 10, 256, 84, "Q2_K"),
    (Q3_K, 11, 256, 110, "Q3_K"),
    (Q4_K, 12, 256, 144, "Q4_K"),
    (Q5_K, 13, 256, 176, "Q5_K"),
    (Q6_K, 14, 256, 210, "Q6_K"),
    (Q8_K, 15, 256, 292, "Q8_K"),
    (IQ2_XXS, 16, 256, 66, "IQ2_XXS"),
    (IQ2_XS, 17, 256, 74, "IQ2_XS"),
    (IQ3_XXS, 18, 256, 98, "IQ3_XXS"),
    (IQ1_S, 19, 256, 50, "IQ1_S"),
    (IQ4_NL, 20, 32, 18, "IQ4_NL"),
    (IQ3_S, 21, 256, 110, "IQ3_S"),
    (IQ2_S, 22, 256, 82, "IQ2_S"),
    (IQ4_XS, 23, 256, 136, "IQ4_XS"),
    (I8, 24, 1, 1, "I8"),
    (I16, 25, 1, 2, "I16"),
    (I32, 26, 1, 4, "I32"),
    (I64, 27, 1, 8, "I64"),
    (F64, 28, 1, 8, "F64"),
    (IQ1_M, 29, 256, 56, "IQ1_M"),
    (BF16, 30, 1, 2, "BF16"),
    (TQ1_0, 34, 256, 54, "TQ1_0"),
    (TQ2_0, 35, 256, 66, "TQ2_0"),
    (MXFP4, 39, 32, 17, "MXFP4"),
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }
    fn row(self) -> &'static (GgmlType, u32, usize, usize, &'static str) {
        TABLE
            .iter()
            .find(|r| r.0 == self)
            .expect("every GgmlType is in TABLE")
    }
    pub fn id(self) -> u32 {
        self.row().1
    }
    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.row().2
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().3
    }
    pub fn name(self) -> &'static str {
        self.row().4
    }
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE
            .iter()
            .find(|r| r.4.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|r| r.0)
    }
    /// Bits per weight of the stored form.
    pub fn bits_per_weight(self) -> f64 {
        self.type_size() as f64 * 8.0 / self.block_size() as f64
    }
    /// Whether hf2q can dequantize (and so compute with) this type.
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            F32 | F16
                | BF16
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | Q8_K
                | MXFP4
        )
    }
    /// Bytes for a row of `n` elements, or `None` if `n` is not a whole number of blocks or the
    /// size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(Q4_K.row_bytes(512), Some(288));
        assert_eq!(Q4_K.row_bytes(576), None);
    }
}
