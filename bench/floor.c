/* The floor of kvtrace's own job: one pass, one thread, over what a first `kvtrace diff` must take out of an
 * Nsight Systems export, with nothing done to the values but reading them.
 *
 *     kvtrace-floor FILE...
 *
 * Per file: every kernel row's start, end, device, correlationId, process, names and launch shape; every launch
 * call's correlationId, thread and start (runtime rows whose name contains "Launch"); every closed NVTX range's
 * start, end, thread, name and domain. Each value is read with sqlite3_column_int64 (text with
 * sqlite3_column_bytes) and folded into a checksum, so that no read can be skipped. Prints the row counts and
 * the checksum per file, with the wall seconds per table; bench/run.py times the whole process.
 */
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const char KERNELS[] =
    "SELECT start, \"end\", deviceId, correlationId, globalPid, demangledName, shortName, "
    "gridX, gridY, gridZ, blockX, blockY, blockZ FROM CUPTI_ACTIVITY_KIND_KERNEL";
/* kvtrace reads the launch calls' StringIds first; the subquery is evaluated once, as that list. */
static const char LAUNCHES[] =
    "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME "
    "WHERE nameId IN (SELECT id FROM StringIds WHERE value GLOB '*Launch*')";
static const char RANGES[] =
    "SELECT start, \"end\", globalTid, textId, domainId, text FROM NVTX_EVENTS "
    "WHERE eventType IN (59, 60, 70, 71) AND \"end\" IS NOT NULL AND endGlobalTid IS NULL";

static void fail(sqlite3 *db, const char *what) {
    fprintf(stderr, "kvtrace-floor: %s: %s\n", what, db ? sqlite3_errmsg(db) : "out of memory");
    exit(2);
}

/* Steps through a query, folding every integer column (and the length of the text columns) into *sum. */
static int64_t scan(sqlite3 *db, const char *sql, int text_columns_from, uint64_t *sum) {
    sqlite3_stmt *stmt;
    if (sqlite3_prepare_v2(db, sql, -1, &stmt, NULL) != SQLITE_OK) fail(db, sql);
    int columns = sqlite3_column_count(stmt);
    int64_t rows = 0;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
        uint64_t row = 0;
        for (int c = 0; c < columns; c++)
            row = row * 31 + (uint64_t)(c < text_columns_from ? sqlite3_column_int64(stmt, c)
                                                              : sqlite3_column_bytes(stmt, c));
        *sum += row;
        rows++;
    }
    if (rc != SQLITE_DONE) fail(db, sql);
    sqlite3_finalize(stmt);
    return rows;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: kvtrace-floor FILE...\n");
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        char *uri = sqlite3_mprintf("file:%s?mode=ro&immutable=1", argv[i]);
        sqlite3 *db;
        if (sqlite3_open_v2(uri, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, NULL) != SQLITE_OK) fail(db, argv[i]);
        sqlite3_free(uri);
        uint64_t sum = 0;
        double t0 = now();
        int64_t kernels = scan(db, KERNELS, 13, &sum);
        double t1 = now();
        int64_t launches = scan(db, LAUNCHES, 3, &sum);
        double t2 = now();
        int64_t ranges = scan(db, RANGES, 5, &sum);
        double t3 = now();
        printf("%s: %lld kernels in %.2f s, %lld launch calls in %.2f s, %lld NVTX ranges in %.2f s "
               "(checksum %016llx)\n", argv[i], (long long)kernels, t1 - t0, (long long)launches, t2 - t1,
               (long long)ranges, t3 - t2, (unsigned long long)sum);
        sqlite3_close(db);
    }
    return 0;
}
