/* smr117.h: libfabric 1.17's shm region layout, as the units that read it in a region (forget.c,
 * shmlock.c, unblock.c) name it; each checks what it uses in the region before trusting it
 * (version, pid, the queues' places), so another layout turns that unit off, never misreads.
 *
 * struct smr_region (include/ofi_shm.h): version (uint8) at 0, the owner's pid at 4, its spin
 * lock at 24, signal at 28, total_size at 40, cmd_queue_offset at 64, resp_queue_offset at 72,
 * inject_pool_offset at 80, peer_data_offset at 96, name_offset at 104. Each queue an
 * ofi_cirque: size, size_mask, read count, write count (size_t each), then the entries:
 * commands of 256 bytes, responses of 16 (struct smr_resp: msg_id, status). The peer table:
 * 256 struct smr_peer_data of 272 bytes (name[256], the id as int64, sar_status, name_sent). */
#ifndef KVXFER_SMR117_H
#define KVXFER_SMR117_H

#include <stdint.h>
#include <string.h>

#define KX_SMR_VERSION 4
#define KX_SMR_PID_OFF 4
#define KX_SMR_LOCK_OFF 24
#define KX_SMR_SIGNAL_OFF 28
#define KX_SMR_TOTAL_OFF 40
#define KX_SMR_CMDQ_OFF 64
#define KX_SMR_RESPQ_OFF 72
#define KX_SMR_INJECT_OFF 80
#define KX_SMR_PEERS_OFF 96
#define KX_SMR_NAME_OFF 104
#define KX_SMR_CMD_SIZE 256
#define KX_SMR_RESP_SIZE 16
#define KX_SMR_MAX_PEERS 256
#define KX_SMR_PEER_SIZE 272
#define KX_SMR_PEER_ID 256
#define KX_SMR_PEER_SAR 264
#define KX_SMR_PEER_NAME_SENT 268

/* a size_t of the region at byte `off` (the caller checked the bounds) */
static inline uint64_t kx_smr_u64(const unsigned char *b, size_t off)
{
    uint64_t v;
    memcpy(&v, b + off, sizeof(v));
    return v;
}

static inline int kx_smr_pow2(uint64_t v)
{
    return v && !(v & (v - 1));
}

#endif
