/*
 * Fuzz target: the record validator and decoder. The input is one record. Decoding must succeed
 * exactly when validation does, and walking the decoded tree must stay inside the record (see
 * ts__fz_check_record for every property checked).
 */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    (void)ts__fz_check_record(data, size);
    return 0;
}
