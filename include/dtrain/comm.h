#pragma once
// Umbrella header for the communication layer.
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/all_to_all.h"
#include "dtrain/comm/barrier.h"
#include "dtrain/comm/broadcast.h"
#include "dtrain/comm/init.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/reduce_scatter.h"
#include "dtrain/comm/send_recv.h"
#include "dtrain/comm/split.h"
#include "dtrain/comm/types.h"
#include "dtrain/comm/work.h"
